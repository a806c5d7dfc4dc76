#include "server/session.h"

#include <spdlog/spdlog.h>

#include "crypto/tls.h"
#include "proto/frame.h"
#include "server/config.h"

namespace estuary::server {

namespace asio = boost::asio;
using boost::system::error_code;


Session::Session(SslStream stream, std::string address, SessionListener& listener, const ServerConfig& config)
    : stream_(std::move(stream)),
      address_(std::move(address)),
      listener_(listener),
      config_(config),
      timer_(stream_.get_executor()) {}

void Session::Start() {
  timer_.expires_after(std::chrono::milliseconds(int64_t(config_.handshake_timeout_s * 1000)));
  timer_.async_wait([self = shared_from_this()](const error_code& ec) {
    if (!ec && self->name_.empty()) self->Fail("handshake timed out");
  });
  stream_.async_handshake(asio::ssl::stream_base::server,
                          [self = shared_from_this()](const error_code& ec) { self->OnHandshake(ec); });
}

void Session::OnHandshake(const error_code& ec) {
  if (closed_) return;
  if (ec) {
    const std::string reason = crypto::HandshakeFailureReason(stream_.native_handle(), ec);
    listener_.OnHandshakeRefused(address_, reason);
    Close();
    return;
  }
  auto name = crypto::PeerCommonName(stream_.native_handle());
  if (!name.ok()) {
    listener_.OnHandshakeRefused(address_, name.status().message());
    Close();
    return;
  }
  name_ = *name;
  peer_serial_ = crypto::PeerSerial(stream_.native_handle());
  ArmIdleTimer();
  ReadHeader();
}

void Session::ArmIdleTimer() {
  timer_.expires_after(std::chrono::milliseconds(int64_t(config_.idle_timeout_s * 1000)));
  timer_.async_wait([self = shared_from_this()](const error_code& ec) {
    if (!ec) self->Fail(fmt::format("no frame for {} s", self->config_.idle_timeout_s));
  });
}

void Session::ReadHeader() {
  if (closed_ || paused_ || read_pending_) return;
  read_pending_ = true;
  asio::async_read(stream_, asio::buffer(header_), [self = shared_from_this()](const error_code& ec, size_t) {
    self->read_pending_ = false;
    if (self->closed_) return;
    if (ec) return self->Fail(ec == asio::error::eof ? "connection closed by peer" : ec.message());
    auto size = proto::ParseFrameHeader(self->header_, self->config_.max_frame_bytes);
    if (!size.ok()) {
      self->listener_.OnBadFrame(*self, size.status().message());
      return self->SendErrorAndClose(v1::Error::BAD_FRAME, size.status().message());
    }
    self->ReadBody(*size);
  });
}

void Session::ReadBody(uint32_t size) {
  body_.Resize(size);
  read_pending_ = true;
  asio::async_read(stream_, asio::buffer(body_.data(), body_.size()), [self = shared_from_this()](const error_code& ec, size_t) {
    self->read_pending_ = false;
    if (self->closed_) return;
    if (ec) return self->Fail(ec == asio::error::eof ? "connection closed by peer" : ec.message());
    auto envelope = proto::ParseEnvelope(self->body_.data(), self->body_.size());
    if (!envelope.ok()) {
      self->listener_.OnBadFrame(*self, envelope.status().message());
      return self->SendErrorAndClose(v1::Error::BAD_FRAME, envelope.status().message());
    }
    self->ArmIdleTimer();
    self->Dispatch(std::move(envelope).value());
    self->body_.Trim();
    self->ReadHeader();
  });
}

void Session::Dispatch(v1::Envelope envelope) {
  if (!hello_seen_) {
    if (envelope.body_case() != v1::Envelope::kHello) {
      const std::string what = fmt::format("expected hello first, got {}", proto::BodyName(envelope));
      listener_.OnBadFrame(*this, what);
      return SendErrorAndClose(v1::Error::BAD_MESSAGE, what);
    }
    hello_seen_ = true;
    return listener_.OnHello(shared_from_this(), envelope.hello());
  }
  if (envelope.body_case() == v1::Envelope::kHeartbeat) {
    return Send(envelope);  // echoed, so the client can tell the server is alive
  }
  listener_.OnMessage(shared_from_this(), std::move(envelope));
}

void Session::Resume() {
  paused_ = false;
  ReadHeader();
}

void Session::Send(const v1::Envelope& envelope) {
  if (closed_ || close_after_writes_) return;
  outbox_.push_back(std::make_shared<const proto::Frame>(proto::EncodeFrame(envelope)));
  WriteNext();
}

void Session::SendModel(uint64_t round, std::shared_ptr<const std::vector<float>> model,
                        std::function<void()> on_sent, std::vector<std::pair<uint64_t, uint64_t>> ranges,
                        std::shared_ptr<const std::vector<float>> tail) {
  model_ = std::move(model);
  model_tail_ = std::move(tail);
  model_round_ = round;
  if (ranges.empty()) ranges = {{0, model_->size() * sizeof(float)}};
  model_ranges_ = std::move(ranges);
  model_range_ = 0;
  model_offset_ = model_ranges_[0].first;
  on_model_sent_ = std::move(on_sent);
  model_last_chunk_queued_ = false;
  WriteNext();
}

void Session::SendErrorAndClose(v1::Error::Code code, const std::string& message) {
  if (closed_ || close_after_writes_) return;
  v1::Envelope envelope;
  envelope.mutable_error()->set_code(code);
  envelope.mutable_error()->set_message(message);
  Send(envelope);
  CloseAfterWrites();
}

void Session::CloseAfterWrites() {
  close_after_writes_ = true;
  model_.reset();
  model_tail_.reset();
  if (!writing_ && outbox_.empty()) Close();
}

void Session::WriteNext() {
  if (writing_ || closed_) return;
  if (outbox_.empty() && model_) {
    const uint64_t end = model_ranges_[model_range_].second;
    const uint64_t size = std::min<uint64_t>(config_.chunk_bytes, end - model_offset_);
    const uint64_t model_bytes = model_->size() * sizeof(float);
    const char* source = model_offset_ < model_bytes
                             ? reinterpret_cast<const char*>(model_->data()) + model_offset_
                             : reinterpret_cast<const char*>(model_tail_->data()) + (model_offset_ - model_bytes);
    outbox_.push_back(std::make_shared<const proto::Frame>(
        proto::EncodeModelChunk(model_round_, model_offset_, source, size)));
    model_offset_ += size;
    if (model_offset_ == end && ++model_range_ < model_ranges_.size()) model_offset_ = model_ranges_[model_range_].first;
    if (model_range_ == model_ranges_.size()) {
      model_.reset();
      model_tail_.reset();
      model_last_chunk_queued_ = true;
    }
  }
  if (outbox_.empty()) {
    if (close_after_writes_) Close();
    return;
  }
  writing_ = true;
  auto frame = outbox_.front();
  asio::async_write(stream_, asio::buffer(frame->data(), frame->size()), [self = shared_from_this(), frame](const error_code& ec, size_t) {
    self->writing_ = false;
    self->outbox_.pop_front();
    if (ec) return self->Fail(ec.message());
    if (self->model_last_chunk_queued_ && self->outbox_.empty()) {
      self->model_last_chunk_queued_ = false;
      if (auto on_sent = std::move(self->on_model_sent_)) on_sent();
    }
    self->WriteNext();
  });
}

void Session::Fail(const std::string& reason) {
  if (closed_) return;
  if (!name_.empty()) spdlog::info("session {} ({}): {}", name_, address_, reason);
  Close();
}

void Session::Close() {
  if (closed_) return;
  closed_ = true;
  timer_.cancel();
  model_.reset();
  model_tail_.reset();
  if (auto on_sent = std::move(on_model_sent_)) on_sent();  // the stream is over either way
  error_code ignored;
  stream_.lowest_layer().shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
  stream_.lowest_layer().close(ignored);
  if (hello_seen_) listener_.OnClosed(*this);
}

}  // namespace estuary::server
