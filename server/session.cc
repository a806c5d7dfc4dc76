#include "server/session.h"

#include <spdlog/spdlog.h>

#include "crypto/tls.h"
#include "proto/frame.h"
#include "server/buffer_budget.h"
#include "server/config.h"

namespace estuary::server {

namespace asio = boost::asio;
using boost::system::error_code;

namespace {

// Buffers up to this size a session keeps anyway (BodyBuffer); only larger
// ones are charged to the budget.
constexpr uint64_t kUnchargedBytes = 64 << 10;
// How soon a session that found the budget spent tries again.
constexpr auto kBudgetRetry = std::chrono::milliseconds(20);

uint64_t ChargeFor(uint64_t bytes) { return bytes > kUnchargedBytes ? bytes : 0; }

std::chrono::milliseconds Millis(double seconds) { return std::chrono::milliseconds(int64_t(seconds * 1000)); }

}  // namespace

Session::Session(SslStream stream, std::string address, const Context& context, Milestones milestones)
    : stream_(std::move(stream)),
      address_(std::move(address)),
      context_(context),
      milestones_(std::move(milestones)),
      handshake_timer_(stream_.get_executor()),
      idle_timer_(stream_.get_executor()),
      write_timer_(stream_.get_executor()),
      read_wait_(stream_.get_executor()),
      write_wait_(stream_.get_executor()) {}

// The last handler has run: nothing else touches the budget or the milestones.
Session::~Session() {
  FireMilestone(milestones_.handshake_ended);
  FireMilestone(milestones_.identified);
  context_.budget->Give(body_charge_);
  context_.budget->Give(listener_charge_);
  for (const Queued& q : outbox_) context_.budget->Give(q.charge);
}

void Session::FireMilestone(std::function<void()>& milestone) {
  if (auto fire = std::move(milestone)) {
    milestone = nullptr;
    fire();
  }
}

void Session::Start() {
  asio::dispatch(stream_.get_executor(), [self = shared_from_this()] {
    self->handshake_timer_.expires_after(Millis(self->context_.config->handshake_timeout_s));
    self->handshake_timer_.async_wait([self](const error_code& ec) {
      if (!ec && !self->handshake_ended_) self->Fail("handshake timed out");
    });
    self->stream_.async_handshake(asio::ssl::stream_base::server,
                                  [self](const error_code& ec) { self->OnHandshake(ec); });
  });
}

void Session::OnHandshake(const error_code& ec) {
  handshake_ended_ = true;
  handshake_timer_.cancel();
  FireMilestone(milestones_.handshake_ended);
  if (closed_) return;
  std::string refused;
  if (ec) {
    refused = crypto::HandshakeFailureReason(stream_.native_handle(), ec);
  } else if (auto name = crypto::PeerCommonName(stream_.native_handle()); !name.ok()) {
    refused = name.status().message();
  } else {
    name_ = *name;
  }
  if (!refused.empty()) {
    if (context_.metrics) context_.metrics->HandshakeRefused();
    asio::post(context_.listener_strand, [listener = context_.listener, address = address_, refused] {
      listener->OnHandshakeRefused(address, refused);
    });
    return Shutdown();
  }
  peer_serial_ = crypto::PeerSerial(stream_.native_handle());
  ReadHeader();
}

void Session::ArmIdleTimer() {
  const uint64_t arm = ++idle_arms_;
  idle_timer_.expires_after(Millis(context_.config->idle_timeout_s));
  idle_timer_.async_wait([self = shared_from_this(), arm](const error_code& ec) {
    if (ec || self->idle_arms_ != arm) return;
    self->Fail(fmt::format("no frame for {} s", self->context_.config->idle_timeout_s));
  });
}

// A wait that had come due before this still finds its arm outdated.
void Session::StopIdleTimer() {
  ++idle_arms_;
  idle_timer_.cancel();
}

void Session::ReadHeader() {
  if (closed_ || paused_ || reading_ || ahead_ || (with_listener_ && !read_ahead_)) return;
  reading_ = true;
  ArmIdleTimer();
  asio::async_read(stream_, asio::buffer(header_),
                   [self = shared_from_this()](const error_code& ec, size_t) { self->OnHeader(ec); });
}

void Session::OnHeader(const error_code& ec) {
  if (closed_) return;
  if (ec) return Fail(ec == asio::error::eof ? "connection closed by peer" : ec.message());
  const uint64_t max_frame = context_.config->max_frame_bytes;
  const bool before_hello = !hello_seen_ && proto::kMaxHelloFrameBytes < max_frame;
  auto size = proto::ParseFrameHeader(header_, before_hello ? proto::kMaxHelloFrameBytes : max_frame);
  if (!size.ok()) {
    reading_ = false;
    const std::string reason = size.status().message() + (before_hello ? " before hello" : "");
    ReportBadFrame(reason);
    return ErrorAndClose(v1::Error::BAD_FRAME, reason);
  }
  frame_size_ = *size;
  ReadBody();
}

void Session::ReadBody() {
  if (closed_) return;
  const uint64_t charge = ChargeFor(frame_size_);
  if (!context_.budget->TryTake(charge)) {
    // The server holds the session now, not its peer.
    StopIdleTimer();
    read_wait_.expires_after(kBudgetRetry);
    read_wait_.async_wait([self = shared_from_this()](const error_code& ec) {
      if (ec || self->closed_) return;
      self->ArmIdleTimer();
      self->ReadBody();
    });
    return;
  }
  body_charge_ = charge;
  body_.Resize(frame_size_);
  asio::async_read(stream_, asio::buffer(body_.data(), body_.size()), crypto::WholeBuffer,
                   [self = shared_from_this()](const error_code& ec, size_t) { self->OnBody(ec); });
}

void Session::OnBody(const error_code& ec) {
  if (closed_) return;
  reading_ = false;
  StopIdleTimer();
  if (ec) return Fail(ec == asio::error::eof ? "connection closed by peer" : ec.message());
  if (context_.metrics) context_.metrics->BytesReceived(header_.size() + body_.size());
  auto envelope = proto::ParseEnvelope(body_.data(), body_.size());
  // The envelope holds its own copy: the buffer goes back now, its charge
  // once the listener is done with the envelope.
  body_.Trim();
  if (!envelope.ok()) {
    GiveBackBody();
    ReportBadFrame(envelope.status().message());
    return ErrorAndClose(v1::Error::BAD_FRAME, envelope.status().message());
  }
  Dispatch(std::move(envelope).value());
}

void Session::GiveBackBody() {
  context_.budget->Give(body_charge_);
  body_charge_ = 0;
}

void Session::ReportBadFrame(const std::string& reason) {
  asio::post(context_.listener_strand, [self = shared_from_this(), reason] {
    self->context_.listener->OnBadFrame(*self, reason);
  });
}

void Session::Dispatch(v1::Envelope envelope) {
  if (!hello_seen_) {
    if (envelope.body_case() != v1::Envelope::kHello) {
      GiveBackBody();
      const std::string what = fmt::format("expected hello first, got {}", proto::BodyName(envelope));
      ReportBadFrame(what);
      return ErrorAndClose(v1::Error::BAD_MESSAGE, what);
    }
    hello_seen_ = true;
    FireMilestone(milestones_.identified);
  } else if (envelope.body_case() == v1::Envelope::kHeartbeat) {
    GiveBackBody();
    // Echoed, so the client can tell the server is alive: one at a time, so
    // a peer that never reads its echoes cannot queue them without end, and
    // rebuilt from its timestamp alone, so fields this server does not know
    // (which protobuf would carry along) cannot make the echo large.
    if (!heartbeat_queued_) {
      heartbeat_queued_ = true;
      v1::Envelope echo;
      echo.mutable_heartbeat()->set_sent_unix_ms(envelope.heartbeat().sent_unix_ms());
      Queue(std::make_shared<const proto::Frame>(proto::EncodeFrame(echo)), true, 0);
    }
    return ReadHeader();
  }
  if (with_listener_ || paused_) {
    ahead_ = std::move(envelope);  // read ahead: it follows once the listener is done (and resumes)
    return;
  }
  with_listener_ = true;
  listener_charge_ = body_charge_;
  body_charge_ = 0;
  // A chunk of an update under way neither opens nor ends it, so the
  // listener pauses no session for it: the next frame may be read (and
  // decrypted) while the listener stages this one.
  read_ahead_ = envelope.body_case() == v1::Envelope::kUpdateChunk;
  asio::post(context_.listener_strand, [self = shared_from_this(), envelope = std::move(envelope)]() mutable {
    SessionListener& listener = *self->context_.listener;
    if (envelope.body_case() == v1::Envelope::kHello) {
      listener.OnHello(self, envelope.hello());
    } else {
      listener.OnMessage(self, std::move(envelope));
    }
    // After whatever the listener asked of the session, so a Pause holds first.
    asio::post(self->stream_.get_executor(), [self] { self->OnListenerDone(); });
  });
  ReadHeader();  // reads ahead if read_ahead_
}

void Session::OnListenerDone() {
  with_listener_ = false;
  read_ahead_ = false;
  context_.budget->Give(listener_charge_);
  listener_charge_ = 0;
  Continue();
}

void Session::Continue() {
  if (closed_ || paused_) return;
  if (ahead_ && !with_listener_) {
    v1::Envelope next = std::move(*ahead_);
    ahead_.reset();
    return Dispatch(std::move(next));
  }
  ReadHeader();
}

void Session::Pause() {
  asio::post(stream_.get_executor(), [self = shared_from_this()] {
    self->paused_ = true;
    self->StopIdleTimer();  // a read ahead under way waits for the server now, not its peer
  });
}

void Session::Resume() {
  asio::post(stream_.get_executor(), [self = shared_from_this()] {
    self->paused_ = false;
    if (self->reading_) self->ArmIdleTimer();
    self->Continue();
  });
}

void Session::Send(const v1::Envelope& envelope) {
  auto frame = std::make_shared<const proto::Frame>(proto::EncodeFrame(envelope));
  asio::post(stream_.get_executor(), [self = shared_from_this(), frame = std::move(frame)]() mutable {
    const uint64_t charge = ChargeFor(frame->size());
    self->context_.budget->Force(charge);  // a session bounds its own queue
    self->Queue(std::move(frame), false, charge);
  });
}

void Session::SendModel(uint64_t round, std::shared_ptr<const std::vector<float>> model,
                        std::function<void()> on_sent, std::vector<std::pair<uint64_t, uint64_t>> ranges,
                        std::shared_ptr<const std::vector<float>> tail) {
  asio::post(stream_.get_executor(), [self = shared_from_this(), round, model = std::move(model),
                                      on_sent = std::move(on_sent), ranges = std::move(ranges),
                                      tail = std::move(tail)]() mutable {
    self->StartModel(round, std::move(model), std::move(on_sent), std::move(ranges), std::move(tail));
  });
}

void Session::SendErrorAndClose(v1::Error::Code code, const std::string& message) {
  asio::post(stream_.get_executor(), [self = shared_from_this(), code, message] { self->ErrorAndClose(code, message); });
}

void Session::CloseAfterWrites() {
  asio::post(stream_.get_executor(), [self = shared_from_this()] { self->CloseWhenWritten(); });
}

void Session::Close() {
  asio::post(stream_.get_executor(), [self = shared_from_this()] { self->Shutdown(); });
}

void Session::Queue(std::shared_ptr<const proto::Frame> frame, bool heartbeat, uint64_t charge) {
  if (closed_ || close_after_writes_) {
    context_.budget->Give(charge);
    return;
  }
  queued_bytes_ += frame->size();
  outbox_.push_back({std::move(frame), charge, heartbeat});
  if (queued_bytes_ > 2 * context_.config->max_frame_bytes) {
    return Fail(fmt::format("the peer does not read: {} bytes queued for it", queued_bytes_));
  }
  WriteNext();
}

void Session::StartModel(uint64_t round, std::shared_ptr<const std::vector<float>> model,
                         std::function<void()> on_sent, std::vector<std::pair<uint64_t, uint64_t>> ranges,
                         std::shared_ptr<const std::vector<float>> tail) {
  // A stream still running (a retried round's) is over: its callback runs
  // too, and its chunks already queued go before the new round's start.
  ModelStreamOver();
  on_model_sent_ = std::move(on_sent);
  if (closed_ || close_after_writes_) return ModelStreamOver();
  model_ = std::move(model);
  model_tail_ = std::move(tail);
  model_round_ = round;
  if (ranges.empty()) ranges = {{0, model_->size() * sizeof(float)}};
  model_ranges_ = std::move(ranges);
  model_range_ = 0;
  model_offset_ = model_ranges_[0].first;
  model_last_chunk_queued_ = false;
  WriteNext();
}

// The stream's callback belongs to the listener's strand.
void Session::ModelStreamOver() {
  if (auto on_sent = std::move(on_model_sent_)) {
    on_model_sent_ = nullptr;
    asio::post(context_.listener_strand, std::move(on_sent));
  }
}

void Session::ErrorAndClose(v1::Error::Code code, const std::string& message) {
  if (closed_ || close_after_writes_) return;
  v1::Envelope envelope;
  envelope.mutable_error()->set_code(code);
  envelope.mutable_error()->set_message(message);
  Queue(std::make_shared<const proto::Frame>(proto::EncodeFrame(envelope)), false, 0);
  CloseWhenWritten();
}

void Session::CloseWhenWritten() {
  if (closed_) return;
  close_after_writes_ = true;
  model_.reset();
  model_tail_.reset();
  if (!writing_ && outbox_.empty()) Shutdown();
}

// Encodes the model's next chunk into the queue, if the budget has room for it.
bool Session::QueueModelChunk() {
  const uint64_t end = model_ranges_[model_range_].second;
  const uint64_t size = std::min<uint64_t>(context_.config->chunk_bytes, end - model_offset_);
  const uint64_t charge = ChargeFor(size);
  if (!context_.budget->TryTake(charge)) return false;
  const uint64_t model_bytes = model_->size() * sizeof(float);
  const char* source = model_offset_ < model_bytes
                           ? reinterpret_cast<const char*>(model_->data()) + model_offset_
                           : reinterpret_cast<const char*>(model_tail_->data()) + (model_offset_ - model_bytes);
  auto frame = std::make_shared<const proto::Frame>(proto::EncodeModelChunk(model_round_, model_offset_, source, size));
  queued_bytes_ += frame->size();
  outbox_.push_back({std::move(frame), charge, false});
  model_offset_ += size;
  if (model_offset_ == end && ++model_range_ < model_ranges_.size()) model_offset_ = model_ranges_[model_range_].first;
  if (model_range_ == model_ranges_.size()) {
    model_.reset();
    model_tail_.reset();
    model_last_chunk_queued_ = true;
  }
  return true;
}

void Session::WriteNext() {
  if (writing_ || closed_ || waiting_to_write_) return;
  if (outbox_.empty() && model_ && !QueueModelChunk()) {
    waiting_to_write_ = true;
    write_wait_.expires_after(kBudgetRetry);
    write_wait_.async_wait([self = shared_from_this()](const error_code& ec) {
      self->waiting_to_write_ = false;
      if (!ec) self->WriteNext();
    });
    return;
  }
  if (outbox_.empty()) {
    if (close_after_writes_) Shutdown();
    return;
  }
  writing_ = true;
  const auto frame = outbox_.front().frame;
  const uint64_t write = ++writes_;
  write_timer_.expires_after(Millis(context_.config->write_timeout_s));
  write_timer_.async_wait([self = shared_from_this(), write, size = frame->size()](const error_code& ec) {
    if (ec || !self->writing_ || self->writes_ != write) return;
    self->Fail(fmt::format("the peer does not read: a frame of {} bytes not written after {} s", size,
                           self->context_.config->write_timeout_s));
  });
  asio::async_write(stream_, asio::buffer(frame->data(), frame->size()),
                    [self = shared_from_this(), frame](const error_code& ec, size_t) { self->OnWritten(ec); });
}

void Session::OnWritten(const error_code& ec) {
  writing_ = false;
  write_timer_.cancel();
  if (!outbox_.empty()) {
    Queued& done = outbox_.front();
    if (!ec && context_.metrics) context_.metrics->BytesSent(done.frame->size());
    queued_bytes_ -= done.frame->size();
    context_.budget->Give(done.charge);
    if (done.heartbeat) heartbeat_queued_ = false;
    outbox_.pop_front();
  }
  if (closed_) return;
  if (ec) return Fail(ec.message());
  if (model_last_chunk_queued_ && outbox_.empty()) {
    model_last_chunk_queued_ = false;
    ModelStreamOver();
  }
  WriteNext();
}

void Session::Fail(const std::string& reason) {
  if (closed_) return;
  if (!name_.empty()) spdlog::info("session {} ({}): {}", name_, address_, reason);
  Shutdown();
}

void Session::Shutdown() {
  if (closed_) return;
  closed_ = true;
  closed_flag_.store(true, std::memory_order_release);
  handshake_timer_.cancel();
  StopIdleTimer();
  write_timer_.cancel();
  read_wait_.cancel();
  write_wait_.cancel();
  model_.reset();
  model_tail_.reset();
  ModelStreamOver();  // the stream is over either way
  FireMilestone(milestones_.identified);
  error_code ignored;
  stream_.lowest_layer().shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
  stream_.lowest_layer().close(ignored);
  if (hello_seen_) {
    asio::post(context_.listener_strand, [self = shared_from_this()] { self->context_.listener->OnClosed(*self); });
  }
}

}  // namespace estuary::server
