// Session: the server's end of one client connection (a ClientSession).
//
// One object per TLS connection, kept alive by the handlers that hold
// shared_from_this(). It performs the handshake (with a timeout), learns the
// client's name from its certificate, then runs a read loop of frames that
// it hands to its SessionListener, and a write queue drained one frame at a
// time. The global model is streamed lazily: the next chunk is encoded only
// when the previous one has been written, so a slow client holds one chunk,
// not a copy of the model. All of it runs on the server's single I/O thread.
#pragma once

#include "base/asio.h"
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "estuary.pb.h"
#include "proto/frame.h"
#include "server/client_session.h"

namespace estuary::server {

struct ServerConfig;

class Session final : public ClientSession, public std::enable_shared_from_this<Session> {
 public:
  using SslStream = boost::asio::ssl::stream<boost::asio::ip::tcp::socket>;

  Session(SslStream stream, std::string address, SessionListener& listener, const ServerConfig& config);

  void Start();
  void Close();

  // ClientSession
  const std::string& name() const override { return name_; }
  const std::string& peer_serial() const override { return peer_serial_; }
  const std::string& address() const override { return address_; }
  void Send(const v1::Envelope& envelope) override;
  void SendModel(uint64_t round, std::shared_ptr<const std::vector<float>> model, std::function<void()> on_sent,
                 std::vector<std::pair<uint64_t, uint64_t>> ranges,
                 std::shared_ptr<const std::vector<float>> tail) override;
  void SendErrorAndClose(v1::Error::Code code, const std::string& message) override;
  void CloseAfterWrites() override;
  void Pause() override { paused_ = true; }
  void Resume() override;
  bool closed() const override { return closed_; }

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
  SessionListener& listener_;
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
