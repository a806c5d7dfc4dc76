// Session: the server's end of one client connection.
//
// One object per TLS connection, kept alive by the handlers that hold
// shared_from_this(). It performs the handshake (with a timeout), learns the
// client's name from its certificate, then runs a read loop of frames that
// it hands to the Coordinator, and a write queue drained one frame at a time.
// The global model is streamed lazily: the next chunk is encoded only when
// the previous one has been written, so a slow client holds one chunk, not a
// copy of the model. All of it runs on the server's single I/O thread.
#pragma once

#include "base/asio.h"
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "estuary.pb.h"
#include "proto/frame.h"

namespace estuary::server {

class Coordinator;
struct ServerConfig;

class Session : public std::enable_shared_from_this<Session> {
 public:
  using SslStream = boost::asio::ssl::stream<boost::asio::ip::tcp::socket>;

  Session(SslStream stream, std::string address, Coordinator& coordinator, const ServerConfig& config);

  void Start();
  void Send(const v1::Envelope& envelope);
  // Streams `model` as ModelChunk frames for `round` after what is queued;
  // `on_sent` runs once: when the last chunk is written or the session closes.
  // All of it, or only the byte ranges [begin, end) of `ranges` (a patch over
  // a model the client holds; ascending, disjoint, non-empty), no chunk
  // crossing a range. Offsets past the model's end address `tail` (a
  // patch's low-rank factors), from 0 there.
  void SendModel(uint64_t round, std::shared_ptr<const std::vector<float>> model, std::function<void()> on_sent = {},
                 std::vector<std::pair<uint64_t, uint64_t>> ranges = {},
                 std::shared_ptr<const std::vector<float>> tail = nullptr);
  // Sends an Error and closes once it is written.
  void SendErrorAndClose(v1::Error::Code code, const std::string& message);
  // Closes after everything queued is written.
  void CloseAfterWrites();
  void Close();
  // Backpressure: stop reading frames until Resume().
  void Pause() { paused_ = true; }
  void Resume();

  const std::string& name() const { return name_; }
  // The serial of the client's verified certificate (crypto::PeerSerial).
  const std::string& peer_serial() const { return peer_serial_; }
  const std::string& address() const { return address_; }
  bool closed() const { return closed_; }

 private:
  void OnHandshake(const boost::system::error_code& ec);
  void ReadHeader();
  void ReadBody(uint32_t size);
  void Dispatch(v1::Envelope envelope);
  void WriteNext();
  void ArmIdleTimer();
  void Fail(const std::string& reason);

  SslStream stream_;
  std::string address_;
  std::string name_;
  std::string peer_serial_;
  Coordinator& coordinator_;
  const ServerConfig& config_;
  boost::asio::steady_timer timer_;
  std::array<uint8_t, 4> header_{};
  proto::BodyBuffer body_;
  std::deque<std::shared_ptr<const proto::Frame>> outbox_;
  bool writing_ = false;
  bool paused_ = false;
  bool read_pending_ = false;
  bool close_after_writes_ = false;
  bool closed_ = false;
  bool hello_seen_ = false;
  // The model being streamed, if any.
  std::shared_ptr<const std::vector<float>> model_, model_tail_;
  uint64_t model_round_ = 0;
  uint64_t model_offset_ = 0;  // bytes
  std::vector<std::pair<uint64_t, uint64_t>> model_ranges_;  // bytes [begin, end) still to send, in order
  size_t model_range_ = 0;
  std::function<void()> on_model_sent_;
  bool model_last_chunk_queued_ = false;
};

}  // namespace estuary::server
