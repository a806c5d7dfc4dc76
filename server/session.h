// Session: the server's end of one client connection (a ClientSession).
//
// One object per TLS connection, kept alive by the handlers that hold
// shared_from_this(), all of which run on the session's own strand. It
// performs the handshake (with a timeout), learns the client's name from its
// certificate, then reads frames one at a time and hands each to its
// SessionListener on the listener's strand; it reads the next frame only
// once the listener has taken the last, so a Pause() the listener asks for
// holds before another frame is read. The one exception is an update's
// chunk, which the listener never pauses for: while it stages one, the
// session reads (and decrypts) the next, one frame ahead at most, charged
// to the budget like any other, and hands it over once the listener is done. Until its Hello a frame may hold at
// most kMaxHelloFrameBytes. Heartbeats are echoed here, at most one echo
// queued at a time.
//
// Writes drain a queue one frame at a time; a frame not written within
// write_timeout_s, or a queue beyond twice the largest frame, cuts the peer
// off as one that does not read. The global model is streamed lazily: the
// next chunk is encoded only when the previous one has been written, so a
// slow client holds one chunk, not a copy of the model. Frame buffers above
// 64 KiB, received or sent, are charged to the server's BufferBudget; a
// session that finds it spent waits for it. The idle timeout runs only while
// the session waits for its peer: not while the listener holds it paused,
// nor while it waits for the budget.
//
// The ClientSession calls may come from any thread; they are carried over to
// the session's strand, and a stream's on_sent is posted to the listener's.
#pragma once

#include "base/asio.h"
#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "crypto/tls_socket.h"
#include "estuary.pb.h"
#include "proto/frame.h"
#include "server/client_session.h"
#include "server/metrics.h"

namespace estuary::server {

struct ServerConfig;
class BufferBudget;

class Session final : public ClientSession, public std::enable_shared_from_this<Session> {
 public:
  // OpenSSL on the socket itself (crypto/tls_socket.h): one copy fewer
  // each way, and a frame's records read in one completion.
  using SslStream = crypto::TlsSocket;

  // What every session shares; outlives them all.
  struct Context {
    SessionListener* listener;
    boost::asio::any_io_executor listener_strand;  // every listener call runs there
    const ServerConfig* config;
    BufferBudget* budget;
    Metrics* metrics = nullptr;  // bytes and refused handshakes counted there, when given
  };
  // Told once each, on the session's strand (or when it is destroyed): its
  // TLS handshake ended, either way; it said Hello, or closed before.
  struct Milestones {
    std::function<void()> handshake_ended;
    std::function<void()> identified;
  };

  // `stream`'s socket runs on the session's strand.
  Session(SslStream stream, std::string address, const Context& context, Milestones milestones);
  ~Session() override;

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
  void Pause() override;
  void Resume() override;
  bool closed() const override { return closed_flag_.load(std::memory_order_acquire); }

 private:
  struct Queued {
    std::shared_ptr<const proto::Frame> frame;
    uint64_t charge = 0;  // taken from the budget
    bool heartbeat = false;
  };

  // Everything below runs on the session's strand.
  void OnHandshake(const boost::system::error_code& ec);
  void ReadHeader();
  void OnHeader(const boost::system::error_code& ec);
  void ReadBody();
  void OnBody(const boost::system::error_code& ec);
  void Dispatch(v1::Envelope envelope);
  void OnListenerDone();
  void Continue();
  void ReportBadFrame(const std::string& reason);
  void GiveBackBody();
  void Queue(std::shared_ptr<const proto::Frame> frame, bool heartbeat, uint64_t charge);
  void StartModel(uint64_t round, std::shared_ptr<const std::vector<float>> model, std::function<void()> on_sent,
                  std::vector<std::pair<uint64_t, uint64_t>> ranges, std::shared_ptr<const std::vector<float>> tail);
  void ErrorAndClose(v1::Error::Code code, const std::string& message);
  void CloseWhenWritten();
  bool QueueModelChunk();
  void WriteNext();
  void OnWritten(const boost::system::error_code& ec);
  void ModelStreamOver();
  void ArmIdleTimer();
  void StopIdleTimer();
  void Fail(const std::string& reason);
  void Shutdown();
  void FireMilestone(std::function<void()>& milestone);

  SslStream stream_;
  const std::string address_;
  std::string name_;
  std::string peer_serial_;
  const Context context_;
  Milestones milestones_;
  boost::asio::steady_timer handshake_timer_;
  boost::asio::steady_timer idle_timer_;
  boost::asio::steady_timer write_timer_;
  boost::asio::steady_timer read_wait_;   // for the budget, to read a frame
  boost::asio::steady_timer write_wait_;  // for the budget, to encode a model chunk
  std::array<uint8_t, 4> header_{};
  uint32_t frame_size_ = 0;
  uint64_t body_charge_ = 0;      // the frame being received or read ahead, until the listener has it
  uint64_t listener_charge_ = 0;  // the frame with the listener, until it is done
  proto::BodyBuffer body_;
  std::deque<Queued> outbox_;
  uint64_t queued_bytes_ = 0;
  uint64_t writes_ = 0;     // the write timer knows which write it watches,
  uint64_t idle_arms_ = 0;  // and the idle timer which wait
  std::atomic<bool> closed_flag_{false};
  bool closed_ = false;
  bool reading_ = false;         // from a header's read to its body's end
  bool with_listener_ = false;   // a frame handed over, not yet taken
  bool read_ahead_ = false;      // and the next may be read meanwhile
  std::optional<v1::Envelope> ahead_;  // the next, read, waiting for the listener
  bool paused_ = false;
  bool writing_ = false;
  bool waiting_to_write_ = false;
  bool heartbeat_queued_ = false;
  bool close_after_writes_ = false;
  bool handshake_ended_ = false;
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
