// TlsSocket over 127.0.0.1 against itself and against Boost.Asio's
// ssl::stream (the other implementation of the same TLS, over a BIO pair):
// bytes both ways at once, a read that takes every record already waiting,
// and how a connection's end reads. One io_context per test; a timer bounds
// it so that a bug fails instead of hanging.
#include "crypto/tls_socket.h"

#include <gtest/gtest.h>
#include <sys/ioctl.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "crypto/certs.h"
#include "crypto/tls.h"
#include "test_dir.h"

namespace estuary::crypto {
namespace {

namespace asio = boost::asio;
namespace ssl = boost::asio::ssl;
using asio::ip::tcp;
using boost::system::error_code;
using AsioStream = ssl::stream<tcp::socket>;

constexpr auto kTimeout = std::chrono::seconds(30);
constexpr size_t kRecord = 16384;  // TLS's largest record of plaintext

std::vector<uint8_t> Pattern(size_t size, uint32_t seed) {
  std::vector<uint8_t> out(size);
  uint32_t x = seed;
  for (auto& b : out) {
    x = x * 1664525u + 1013904223u;
    b = uint8_t(x >> 24);
  }
  return out;
}

class TlsSocketTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir;
    const auto& d = dir_->path();
    ASSERT_TRUE(InitCa(d).ok());
    ASSERT_TRUE(IssueCertificate(d, "server", {.role = CertRole::kServer}).ok());
    ASSERT_TRUE(IssueCertificate(d, "site-a").ok());
  }
  static void TearDownTestSuite() { delete dir_; }

  void SetUp() override {
    const auto& d = dir_->path();
    auto server = MakeServerContext({d / "server.pem", d / "server.key", d / "ca.pem"});
    auto client = MakeClientContext({d / "site-a.pem", d / "site-a.key", d / "ca.pem"});
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    server_ctx_ = *server;
    client_ctx_ = *client;
    timeout_.async_wait([this](const error_code& ec) {
      if (!ec) io_.stop();
    });
  }

  // Connects `client` to `server` and runs both handshakes; `then` runs once both succeeded.
  template <typename ServerStream, typename ClientStream>
  void Connect(ServerStream& server, ClientStream& client, std::function<void()> then) {
    acceptor_.async_accept(server.lowest_layer(), [&, then](const error_code& ec) {
      ASSERT_FALSE(ec) << ec.message();
      error_code ignored;
      server.lowest_layer().set_option(tcp::no_delay(true), ignored);  // as the server's sessions do
      server.async_handshake(ssl::stream_base::server, [&, then](const error_code& ec) {
        ASSERT_FALSE(ec) << ec.message();
        if (++handshakes_ == 2) then();
      });
    });
    client.lowest_layer().async_connect(acceptor_.local_endpoint(), [&, then](const error_code& ec) {
      ASSERT_FALSE(ec) << ec.message();
      error_code ignored;
      client.lowest_layer().set_option(tcp::no_delay(true), ignored);  // as the agents do
      client.async_handshake(ssl::stream_base::client, [&, then](const error_code& ec) {
        ASSERT_FALSE(ec) << ec.message();
        if (++handshakes_ == 2) then();
      });
    });
  }

  // Each end writes `size` bytes while it reads the other's, at once.
  template <typename ServerStream, typename ClientStream>
  void ExchangeBothWays(size_t size) {
    ServerStream server(io_, *server_ctx_);
    ClientStream client(io_, *client_ctx_);
    const auto from_server = Pattern(size, 1), from_client = Pattern(size, 2);
    std::vector<uint8_t> at_server(size), at_client(size);
    int done = 0;
    auto finish = [&](const char* what, const error_code& ec, size_t n) {
      EXPECT_FALSE(ec) << what << ": " << ec.message();
      EXPECT_EQ(n, size) << what;
      if (++done == 4) timeout_.cancel();
    };
    auto report = [&](const char* what) { return [&, what](const error_code& ec, size_t n) { finish(what, ec, n); }; };
    Connect(server, client, [&] {
      asio::async_write(server, asio::buffer(from_server), report("server write"));
      asio::async_write(client, asio::buffer(from_client), report("client write"));
      asio::async_read(server, asio::buffer(at_server), WholeBuffer, report("server read"));
      asio::async_read(client, asio::buffer(at_client), report("client read"));  // 64 KiB at a time
    });
    io_.run();
    ASSERT_EQ(done, 4) << "timed out";
    EXPECT_TRUE(at_server == from_client);
    EXPECT_TRUE(at_client == from_server);
  }

  static testing::TempDir* dir_;
  std::shared_ptr<ssl::context> server_ctx_, client_ctx_;
  asio::io_context io_;
  tcp::acceptor acceptor_{io_, tcp::endpoint(asio::ip::address_v4::loopback(), 0)};
  asio::steady_timer timeout_{io_, kTimeout};
  int handshakes_ = 0;
};

testing::TempDir* TlsSocketTest::dir_ = nullptr;

// 8 MiB each way fills both ends' socket buffers, so writes wait for the
// reader (OpenSSL's "want write") and are retried, on both ends at once.
TEST_F(TlsSocketTest, CarriesBytesBothWaysAtOnce) { ExchangeBothWays<TlsSocket, TlsSocket>(8 << 20); }
TEST_F(TlsSocketTest, TalksToAsioSslStreamAsServer) { ExchangeBothWays<AsioStream, TlsSocket>(3 << 20); }
TEST_F(TlsSocketTest, TalksToAsioSslStreamAsClient) { ExchangeBothWays<TlsSocket, AsioStream>(3 << 20); }

// Why the class exists: records already in the socket come back from one
// read, where ssl::stream returns one record (16 KiB) a completion.
TEST_F(TlsSocketTest, OneReadTakesEveryRecordAlreadyWaiting) {
  constexpr size_t kSize = 2 * kRecord + 1000;  // three records, inside loopback's first receive window
  TlsSocket server(io_, *server_ctx_);
  TlsSocket client(io_, *client_ctx_);
  const auto sent = Pattern(kSize, 3);
  std::vector<uint8_t> got(1 << 20);
  size_t first_read = 0, total = 0;
  int queued = 0;
  std::function<void()> read_rest;
  read_rest = [&] {
    client.async_read_some(asio::buffer(got.data() + total, got.size() - total), [&](const error_code& ec, size_t n) {
      ASSERT_FALSE(ec) << ec.message();
      if (first_read == 0) first_read = n;
      total += n;
      if (total < kSize) return read_rest();
      timeout_.cancel();
    });
  };
  Connect(server, client, [&] {
    asio::async_write(server, asio::buffer(sent), [&](const error_code& ec, size_t) {
      ASSERT_FALSE(ec) << ec.message();
      // On loopback the kernel queues what was sent before send() returns:
      // every record is at the client now (checked below, not assumed).
      EXPECT_EQ(ioctl(client.lowest_layer().native_handle(), FIONREAD, &queued), 0);
      read_rest();
    });
  });
  io_.run();
  ASSERT_EQ(total, kSize) << "timed out";
  ASSERT_GT(size_t(queued), kSize) << "the records had not all arrived when the client read";
  EXPECT_EQ(first_read, kSize) << "one read should take all " << kSize << " bytes";
  EXPECT_TRUE(std::equal(sent.begin(), sent.end(), got.begin()));
}

// The peer's close_notify reads as eof; a connection closed without one as
// stream_truncated, both as ssl::stream reports them.
TEST_F(TlsSocketTest, EndsAsSslStreamReportsIt) {
  for (const bool close_notify : {true, false}) {
    SCOPED_TRACE(close_notify ? "with close_notify" : "without close_notify");
    io_.restart();
    handshakes_ = 0;
    timeout_.expires_after(kTimeout);
    timeout_.async_wait([this](const error_code& ec) {
      if (!ec) io_.stop();
    });
    TlsSocket server(io_, *server_ctx_);
    TlsSocket client(io_, *client_ctx_);
    error_code ended;
    bool read_done = false;
    char byte = 0;
    Connect(server, client, [&] {
      if (close_notify) {
        EXPECT_EQ(SSL_shutdown(server.native_handle()), 0);  // sent; the peer's not yet received
      }
      error_code ignored;
      server.lowest_layer().close(ignored);
      asio::async_read(client, asio::buffer(&byte, 1), [&](const error_code& ec, size_t) {
        ended = ec;
        read_done = true;
        timeout_.cancel();
      });
    });
    io_.run();
    ASSERT_TRUE(read_done) << "timed out";
    if (close_notify) {
      EXPECT_EQ(ended, asio::error::eof) << ended.message();
    } else {
      EXPECT_EQ(ended, ssl::error::stream_truncated) << ended.message();
    }
  }
}

// OpenSSL's own socket BIO would write with write(2), and SIGPIPE would end
// this process; the write must fail with the connection's error instead.
TEST_F(TlsSocketTest, AWriteToAClosedPeerIsAnErrorNotSigpipe) {
  TlsSocket server(io_, *server_ctx_);
  TlsSocket client(io_, *client_ctx_);
  const auto payload = Pattern(1 << 20, 4);
  error_code failed;
  int writes = 0;
  std::function<void()> write_until_it_fails;
  write_until_it_fails = [&] {
    asio::async_write(client, asio::buffer(payload), [&](const error_code& ec, size_t) {
      ++writes;
      if (ec || writes == 64) {
        failed = ec;
        timeout_.cancel();
        return;
      }
      write_until_it_fails();
    });
  };
  Connect(server, client, [&] {
    error_code ignored;
    server.lowest_layer().close(ignored);  // unread data in its queue: the kernel answers with a reset
    write_until_it_fails();
  });
  io_.run();
  ASSERT_TRUE(failed) << "64 MiB written to a closed peer without an error";
  EXPECT_TRUE(failed == asio::error::broken_pipe || failed == asio::error::connection_reset) << failed.message();
}

}  // namespace
}  // namespace estuary::crypto
