// A TLS connection whose SSL object reads and writes its TCP socket itself.
//
// Boost.Asio's ssl::stream runs OpenSSL over a memory BIO pair: every byte is
// copied once more between Asio's buffer and the pair, and a read completes
// after one TLS record (16 KiB), so one thread serving many connections
// interleaves them record by record. Here OpenSSL reads and writes the
// non-blocking descriptor itself (through a BIO that sends with MSG_NOSIGNAL,
// so a closed peer is an error, not SIGPIPE) and Asio only says when it is ready: a read
// takes every record already in the socket, up to the caller's buffer, in one
// completion; a write hands OpenSSL the caller's bytes directly.
//
// The interface is the part of ssl::stream<tcp::socket> an agent uses
// (AsyncReadStream, AsyncWriteStream, a client or server handshake,
// native_handle, lowest_layer), with ssl::stream's error codes: an OpenSSL
// failure in the SSL category with its packed code, asio::error::eof after
// the peer's close_notify, ssl::error::stream_truncated when the connection
// ends without one. Like ssl::stream it is not thread-safe: one read and one
// write may be pending at a time, from one thread (or strand).
#pragma once

#include <openssl/ssl.h>

#include <cstddef>
#include <utility>

#include "base/asio.h"

namespace estuary::crypto {

// A completion condition for asio::async_read: the rest of the buffer in one
// call (asio::transfer_all asks for 64 KiB at a time), so that a TlsSocket
// hands over every record it already holds.
inline std::size_t WholeBuffer(const boost::system::error_code& ec, std::size_t) {
  return ec ? 0 : ~std::size_t{0};
}

class TlsSocket {
 public:
  using executor_type = boost::asio::any_io_executor;
  using lowest_layer_type = boost::asio::ip::tcp::socket;

  TlsSocket(const executor_type& executor, boost::asio::ssl::context& context);
  TlsSocket(boost::asio::io_context& io, boost::asio::ssl::context& context)
      : TlsSocket(io.get_executor(), context) {}
  // Over a socket already connected (a server's accepted one), on its executor.
  TlsSocket(lowest_layer_type socket, boost::asio::ssl::context& context);
  ~TlsSocket();
  // Movable only while no operation is pending (pending ones hold `this`).
  TlsSocket(TlsSocket&& other) noexcept : socket_(std::move(other.socket_)), ssl_(std::exchange(other.ssl_, nullptr)) {}
  TlsSocket& operator=(TlsSocket&&) = delete;

  executor_type get_executor() { return socket_.get_executor(); }
  SSL* native_handle() { return ssl_; }
  lowest_layer_type& lowest_layer() { return socket_; }

  template <typename Token>
  auto async_handshake(boost::asio::ssl::stream_base::handshake_type type, Token&& token) {
    return boost::asio::async_initiate<Token, void(boost::system::error_code)>(
        [this, type](auto handler) {
          boost::system::error_code ec = Attach(type);
          if (ec) return Complete(std::move(handler), /*inline_call=*/true, ec);
          Handshake(std::move(handler), true);
        },
        token);
  }

  template <typename MutableBuffers, typename Token>
  auto async_read_some(const MutableBuffers& buffers, Token&& token) {
    return boost::asio::async_initiate<Token, void(boost::system::error_code, std::size_t)>(
        [this](auto handler, const MutableBuffers& buffers) {
          Read(FirstNonEmpty<boost::asio::mutable_buffer>(buffers), std::move(handler), true);
        },
        token, buffers);
  }

  template <typename ConstBuffers, typename Token>
  auto async_write_some(const ConstBuffers& buffers, Token&& token) {
    return boost::asio::async_initiate<Token, void(boost::system::error_code, std::size_t)>(
        [this](auto handler, const ConstBuffers& buffers) {
          Write(FirstNonEmpty<boost::asio::const_buffer>(buffers), std::move(handler), true);
        },
        token, buffers);
  }

 private:
  enum class Next { kDone, kWaitRead, kWaitWrite };

  // Binds the SSL object to the connected socket, in client or server mode.
  boost::system::error_code Attach(boost::asio::ssl::stream_base::handshake_type type);
  // Before each OpenSSL call: its error queue and errno say only what that call did.
  static void Prepare();
  // What OpenSSL's answer `result` to the last call means: wait for the
  // socket, or done (with *ec set on failure).
  Next Classify(int result, boost::system::error_code* ec);

  template <typename Buffer, typename Buffers>
  static Buffer FirstNonEmpty(const Buffers& buffers) {
    for (auto it = boost::asio::buffer_sequence_begin(buffers); it != boost::asio::buffer_sequence_end(buffers);
         ++it) {
      if (Buffer(*it).size() > 0) return Buffer(*it);
    }
    return Buffer();
  }

  // A completion inside the initiating call is posted, as Asio requires.
  template <typename Handler, typename... Args>
  void Complete(Handler handler, bool inline_call, Args... args) {
    auto executor = boost::asio::get_associated_executor(handler, get_executor());
    auto call = [handler = std::move(handler), args...]() mutable { std::move(handler)(args...); };
    if (inline_call) {
      boost::asio::post(executor, std::move(call));
    } else {
      boost::asio::dispatch(executor, std::move(call));
    }
  }

  // Waits for the socket, then retries; a failed wait completes the
  // operation (with a byte count of 0 for a read or write: kTransfers).
  template <bool kTransfers, typename Handler, typename Retry>
  void Wait(Next next, Handler handler, Retry retry) {
    socket_.async_wait(
        next == Next::kWaitRead ? lowest_layer_type::wait_read : lowest_layer_type::wait_write,
        [this, handler = std::move(handler), retry](const boost::system::error_code& ec) mutable {
          if (!ec) return retry(std::move(handler));
          if constexpr (kTransfers) {
            Complete(std::move(handler), false, ec, std::size_t{0});
          } else {
            Complete(std::move(handler), false, ec);
          }
        });
  }

  template <typename Handler>
  void Handshake(Handler handler, bool inline_call) {
    Prepare();
    boost::system::error_code ec;
    const Next next = Classify(SSL_do_handshake(ssl_), &ec);
    if (next == Next::kDone) return Complete(std::move(handler), inline_call, ec);
    Wait<false>(next, std::move(handler), [this](Handler h) { Handshake(std::move(h), false); });
  }

  // Takes records until the buffer is full or the socket is drained.
  template <typename Handler>
  void Read(boost::asio::mutable_buffer buffer, Handler handler, bool inline_call) {
    const boost::system::error_code ok;
    if (buffer.size() == 0) return Complete(std::move(handler), inline_call, ok, std::size_t{0});
    std::size_t total = 0;
    for (;;) {
      Prepare();
      std::size_t got = 0;
      const int result = SSL_read_ex(ssl_, static_cast<char*>(buffer.data()) + total, buffer.size() - total, &got);
      if (result == 1) {
        total += got;
        if (total == buffer.size()) break;
        continue;
      }
      boost::system::error_code ec;
      const Next next = Classify(result, &ec);
      // What was read goes first; a failure shows again on the next read.
      if (total > 0) break;
      if (next == Next::kDone) return Complete(std::move(handler), inline_call, ec, std::size_t{0});
      return Wait<true>(next, std::move(handler), [this, buffer](Handler h) { Read(buffer, std::move(h), false); });
    }
    Complete(std::move(handler), inline_call, ok, total);
  }

  template <typename Handler>
  void Write(boost::asio::const_buffer buffer, Handler handler, bool inline_call) {
    const boost::system::error_code ok;
    if (buffer.size() == 0) return Complete(std::move(handler), inline_call, ok, std::size_t{0});
    Prepare();
    std::size_t wrote = 0;
    const int result = SSL_write_ex(ssl_, buffer.data(), buffer.size(), &wrote);
    if (result == 1) return Complete(std::move(handler), inline_call, ok, wrote);
    boost::system::error_code ec;
    const Next next = Classify(result, &ec);
    if (next == Next::kDone) return Complete(std::move(handler), inline_call, ec, std::size_t{0});
    // OpenSSL wants the same buffer again (it may hold part of a record).
    Wait<true>(next, std::move(handler), [this, buffer](Handler h) { Write(buffer, std::move(h), false); });
  }

  lowest_layer_type socket_;
  SSL* ssl_;
};

}  // namespace estuary::crypto
