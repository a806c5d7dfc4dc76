#include "client/agent.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "client/held_base.h"
#include "crypto/sha256.h"
#include "crypto/tls.h"
#include "proto/frame.h"
#include "proto/model_patch.h"
#include "proto/wire.h"

namespace estuary::client {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;


Agent::Agent(asio::io_context& io, AgentOptions options, Trainer& trainer, Executor training)
    : io_(io),
      options_(std::move(options)),
      trainer_(trainer),
      training_(std::move(training)),
      resolver_(io),
      reconnect_timer_(io),
      heartbeat_timer_(io),
      stage_timer_(io),
      read_timer_(io),
      write_timer_(io),
      chunk_bytes_(options_.chunk_bytes) {}

namespace {

std::chrono::steady_clock::duration Seconds(double seconds) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
}

// A deadline timer's wait ends with success when it fires, but also when it
// fired just before it was re-armed or disarmed (its handler already
// queued); its handler checks the expiry, which re-arming moves on and
// disarming moves to never.
void Disarm(boost::asio::steady_timer& timer) { timer.expires_at(boost::asio::steady_timer::time_point::max()); }
bool Due(const boost::asio::steady_timer& timer) { return boost::asio::steady_timer::clock_type::now() >= timer.expiry(); }

}  // namespace

void Agent::Start() { Connect(); }

void Agent::Stop() {
  stopped_ = true;
  DropUpload();
  reconnect_timer_.cancel();
  heartbeat_timer_.cancel();
  stage_timer_.cancel();
  read_timer_.cancel();
  write_timer_.cancel();
  resolver_.cancel();
  if (stream_) {
    error_code ignored;
    stream_->lowest_layer().close(ignored);
  }
}

std::string Agent::Peer() const {
  const bool ipv6 = options_.host.find(':') != std::string::npos && options_.host.front() != '[';
  return ipv6 ? fmt::format("[{}]:{}", options_.host, options_.port) : fmt::format("{}:{}", options_.host, options_.port);
}

void Agent::ArmStage(const char* stage, const std::string& peer, double seconds) {
  stage_timer_.expires_after(Seconds(seconds));
  stage_timer_.async_wait([self = shared_from_this(), connection = connection_, stage, peer, seconds](const error_code& ec) {
    if (ec || connection != self->connection_ || self->stopped_ || !Due(self->stage_timer_)) return;
    self->resolver_.cancel();
    self->Disconnected(fmt::format("{} {}: timed out after {} s", stage, peer, seconds));
  });
}

Agent::Clock::time_point Agent::Patience(double seconds) const {
  const Clock::time_point until = Clock::now() + Seconds(seconds);
  return awaiting_answer_ ? std::max(until, round_deadline_ + Seconds(seconds)) : until;
}

void Agent::ArmRead() {
  // Once welcomed, the server echoes our heartbeats: allow three of them.
  const double seconds = std::max(options_.read_timeout_s, welcomed_ ? 3 * double(heartbeat_ms_) / 1000 : 0.0);
  read_timer_.expires_at(Patience(seconds));
  read_timer_.async_wait([self = shared_from_this(), connection = connection_](const error_code& ec) {
    if (ec || connection != self->connection_ || self->stopped_ || !Due(self->read_timer_)) return;
    self->Disconnected(fmt::format("read from {}: nothing from the server for {:.1f} s", self->Peer(),
                                   std::chrono::duration<double>(Clock::now() - self->last_frame_).count()));
  });
}

void Agent::Connect() {
  if (stopped_) return;
  const uint64_t connection = ++connection_;
  stream_ = std::make_shared<SslStream>(io_, *options_.tls);
  outbox_.clear();
  writing_ = false;
  awaiting_answer_ = false;
  welcomed_ = false;
  DropUpload();
  secagg_.reset();  // its secrets are this connection's: the server counts a lost session as a dropout
  secagg_upload_.reset();
  secagg_masking_ = false;
  Status named = crypto::VerifyServerName(stream_->native_handle(), options_.host);
  if (named.ok() && options_.identity) named = crypto::UseIdentity(stream_->native_handle(), *options_.identity);
  if (!named.ok()) return Finish(named);
  ArmStage("resolve", options_.host, options_.resolve_timeout_s);
  resolver_.async_resolve(options_.host, std::to_string(options_.port),
                          [self = shared_from_this(), connection, stream = stream_](const error_code& ec, tcp::resolver::results_type results) {
    if (connection != self->connection_ || self->stopped_) return;
    if (ec) return self->Disconnected(fmt::format("resolve {}: {}", self->options_.host, ec.message()));
    self->ArmStage("connect to", self->Peer(), self->options_.connect_timeout_s);
    asio::async_connect(stream->lowest_layer(), results,
                        [self, connection, stream](const error_code& ec, const tcp::endpoint&) {
      if (connection != self->connection_ || self->stopped_) return;
      if (ec) return self->Disconnected(fmt::format("connect to {}: {}", self->Peer(), ec.message()));
      error_code ignored;
      self->stream_->lowest_layer().set_option(tcp::no_delay(true), ignored);
      self->ArmStage("TLS handshake with", self->Peer(), self->options_.handshake_timeout_s);
      stream->async_handshake(asio::ssl::stream_base::client, [self, connection, stream](const error_code& ec) {
        if (connection != self->connection_ || self->stopped_) return;
        Disarm(self->stage_timer_);
        if (crypto::IsCertificateRevokedAlert(ec)) return self->Revoked("the server refused it in the TLS handshake");
        // Not the network: the certificate is not the federation's server's
        // for the host we dialled (another role, another host, another CA,
        // revoked), and will not be next time. Nothing was sent to it.
        if (const std::string refused = crypto::PeerVerifyError(stream->native_handle());
            ec && !refused.empty() && crypto::PeerVerifyErrorIsLasting(stream->native_handle())) {
          return self->Finish(FailedPrecondition(
              "{}: refused the server at {}: its certificate failed verification ({}): it is not the federation's "
              "server for that address; nothing was sent to it",
              self->name_.empty() ? self->options_.label : self->name_, self->Peer(), refused));
        }
        if (ec) {
          return self->Disconnected(fmt::format("TLS handshake with {}: {}", self->Peer(),
                                                crypto::HandshakeFailureReason(stream->native_handle(), ec)));
        }
        self->OnConnected();
      });
    });
  });
}

void Agent::OnConnected() {
  v1::Envelope envelope;
  auto* hello = envelope.mutable_hello();
  hello->set_protocol_version(proto::kProtocolVersion);
  hello->set_client_version("estuary 0.1.0");
  hello->set_num_examples(trainer_.num_examples());
  hello->set_model_version_held(model_version_);
  hello->set_model_checksum_held(model_checksum_);
  hello->set_keeps_model(options_.keep_model);
  hello->set_evaluates(true);  // a trainer that cannot says so per round (EvalReport.supported)
  Send(envelope);
  last_frame_ = Clock::now();
  ArmRead();
  ReadHeader();
}

void Agent::ReadHeader() {
  const uint64_t connection = connection_;
  asio::async_read(*stream_, asio::buffer(header_), [self = shared_from_this(), connection, stream = stream_](const error_code& ec, size_t) {
    if (connection != self->connection_ || self->stopped_) return;
    if (crypto::IsCertificateRevokedAlert(ec)) return self->Revoked("the server refused it in the TLS handshake");
    if (ec) return self->Disconnected(ec == asio::error::eof ? "server closed the connection" : ec.message());
    auto size = proto::ParseFrameHeader(self->header_, self->options_.max_frame_bytes);
    if (!size.ok()) return self->Disconnected(size.status().message());
    self->body_.Resize(*size);
    asio::async_read(*stream, asio::buffer(self->body_.data(), self->body_.size()), crypto::WholeBuffer, [self, connection, stream](const error_code& ec, size_t) {
      if (connection != self->connection_ || self->stopped_) return;
      if (ec) return self->Disconnected(ec.message());
      auto envelope = proto::ParseEnvelope(self->body_.data(), self->body_.size());
      if (!envelope.ok()) return self->Disconnected(envelope.status().message());
      self->last_frame_ = Clock::now();
      self->ArmRead();
      self->Dispatch(std::move(envelope).value());
      self->body_.Trim();
      if (connection == self->connection_ && !self->stopped_) self->ReadHeader();
    });
  });
}

void Agent::Dispatch(v1::Envelope envelope) {
  switch (envelope.body_case()) {
    case v1::Envelope::kWelcome: {
      const auto& welcome = envelope.welcome();
      name_ = welcome.client_name();
      failures_ = 0;
      if (welcome.chunk_bytes() >= 4) chunk_bytes_ = std::min(options_.chunk_bytes, welcome.chunk_bytes() & ~3u);
      if (welcome.heartbeat_ms() > 0) heartbeat_ms_ = welcome.heartbeat_ms();
      welcomed_ = true;
      ArmRead();
      Heartbeat();
      if (on_welcome) on_welcome();
      return;
    }
    case v1::Envelope::kRoundStart: return OnRoundStart(envelope.round_start());
    case v1::Envelope::kModelChunk: return OnModelChunk(envelope.model_chunk());
    case v1::Envelope::kUpdateAck:
      awaiting_answer_ = false;
      if (!envelope.update_ack().accepted()) {
        spdlog::warn("{}: update for round {} refused: {}", name_, envelope.update_ack().round(),
                     envelope.update_ack().detail());
      }
      return;
    case v1::Envelope::kRoundClosed:
      awaiting_answer_ = false;
      if (on_round_closed) on_round_closed(envelope.round_closed());
      if (envelope.round_closed().federation_complete()) Finish(Status::Ok());
      return;
    case v1::Envelope::kHeartbeat: return;
    case v1::Envelope::kSecaggKeys: case v1::Envelope::kSecaggInbox: case v1::Envelope::kSecaggSurvivors:
    case v1::Envelope::kSecaggUnmask:
      return OnSecAgg(envelope);
    case v1::Envelope::kError:
      if (envelope.error().code() == v1::Error::CERTIFICATE_REVOKED) return Revoked(envelope.error().message());
      spdlog::warn("{}: server error {}: {}", name_.empty() ? options_.label : name_,
                   v1::Error::Code_Name(envelope.error().code()), envelope.error().message());
      return;  // the server closes the connection; we reconnect
    default:
      return Disconnected(fmt::format("unexpected {} from the server", proto::BodyName(envelope)));
  }
}

void Agent::OnRoundStart(const v1::RoundStart& start) {
  auto manifest = proto::FromProto(start.manifest(), uint64_t{1} << 34);
  if (!manifest.ok()) return Disconnected(fmt::format("round {}: {}", start.round(), manifest.status().message()));
  round_ = start;
  round_connection_ = connection_;
  // The server's deadline on our clock: it bounds how long an upload may wait for a staging slot.
  const auto to_deadline = std::chrono::milliseconds(start.deadline_unix_ms()) -
                           std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::system_clock::now().time_since_epoch());
  round_deadline_ = Clock::now() + std::max<std::chrono::milliseconds>(to_deadline, std::chrono::milliseconds(0));
  manifest_ = std::move(manifest).value();
  incoming_low_rank_.clear();
  incoming_factors_.clear();
  const std::string& site = name_.empty() ? options_.label : name_;
  std::string refused = RefusalOfBase(options_.base.get(), start.task(), start.round(), site);
  if (refused.empty()) refused = RefusalOfModel(options_.expected_model, start.task(), start.round(), site);
  if (refused.empty()) refused = RefusalOfControl(start, site);
  if (!refused.empty()) return Refuse(start.round(), refused);
  if (Status s = StartSecAgg(start); !s.ok()) return Disconnected(fmt::format("round {}: {}", start.round(), s.message()));
  if (start.model_follows() && start.patch_on_base()) {
    // The base is ours: only the adapter (and what a merge changed) follows.
    if (!options_.base || !start.task().has_hf_base() || start.low_rank_size() > 0 || start.patch_size() == 0) {
      return Disconnected(fmt::format("round {}: a patch on a base model this site was not told to hold", start.round()));
    }
    auto on_base = ModelOnBase(*options_.base, manifest_);
    if (!on_base.ok()) return Disconnected(fmt::format("round {}: {}", start.round(), on_base.status().message()));
    auto patch = proto::ReadModelPatch(start, manifest_);
    if (!patch.ok()) return Disconnected(patch.status().message());
    incoming_ranges_ = patch->ByteRanges(manifest_.total_elements);
    incoming_ = std::move(on_base).value();
  } else if (start.model_follows() && (start.patch_size() > 0 || start.low_rank_size() > 0)) {
    // Only the changed ranges follow: the rest is the model we hold.
    if (!model_ || model_version_ != start.patch_base_version() || model_->size() != manifest_.total_elements) {
      return Disconnected(fmt::format("round {}: a patch on version {}, but we hold version {}", start.round(),
                                      start.patch_base_version(), model_ ? model_version_ : 0));
    }
    auto patch = proto::ReadModelPatch(start, manifest_);
    if (!patch.ok()) return Disconnected(patch.status().message());
    incoming_ranges_ = patch->ByteRanges(manifest_.total_elements);
    // u and v stay empty until their factors arrive (ApplyLowRank).
    for (const proto::LowRankPatch& change : patch->low_rank) {
      incoming_low_rank_.push_back(
          {change.offset, models::LowRankMatrix{.rows = change.rows, .cols = change.cols, .rank = change.rank}});
    }
    incoming_factors_.assign(patch->factor_count(), 0.0f);
    incoming_.assign(model_->begin(), model_->end());
  } else if (start.model_follows()) {
    incoming_.assign(manifest_.total_elements, 0.0f);
    incoming_ranges_ = {{0, manifest_.total_elements * sizeof(float)}};
  }
  ExpectControl(start);  // SCAFFOLD: c follows the model
  if (start.model_follows()) {
    incoming_range_ = 0;
    incoming_offset_ = incoming_ranges_[0].first;
    download_digest_ = std::make_unique<crypto::TransferDigest>();
    // Held bytes before the first range; with low-rank changes the whole
    // buffer is digested once they are applied.
    if (incoming_low_rank_.empty()) download_digest_->Update(incoming_.data(), incoming_offset_);
    return;
  }
  if (!model_ || model_version_ != start.model_version() || !crypto::SameHexDigest(model_checksum_, start.model_checksum())) {
    return Disconnected(fmt::format("round {}: server sent no model but we hold version {}", start.round(), model_version_));
  }
  if (!control_digest_) Train();  // else once c is in
}

void Agent::Refuse(uint64_t round, const std::string& reason) {
  spdlog::error("{}", reason);
  round_.reset();
  v1::Envelope envelope;
  envelope.mutable_refusal()->set_round(round);
  envelope.mutable_refusal()->set_reason(reason);
  // A base that is not the federation's does not become it by retrying:
  // once the server has closed the connection the agent finishes.
  finish_when_written_ = FailedPrecondition("{}", reason);
  Send(envelope);
}

void Agent::OnTrained(uint64_t round, Result<Update> update) {
  busy_training_ = false;
  if (train_again_) {
    train_again_ = false;
    if (update.ok() && update->stream) Discard(update->stream);
    return Train();
  }
  // A result for a round announced on an earlier connection is stale: the
  // server has either restarted that round (and will say so) or moved on.
  if (stopped_ || !round_ || round_->round() != round || round_->evaluate_only() || round_connection_ != connection_) {
    if (update.ok() && update->stream) Discard(update->stream);
    return;
  }
  if (!update.ok()) {
    spdlog::error("{}: round {}: {}", name_, round, update.status().ToString());
    // The server records why and need not wait for this site; it stays for the next round.
    v1::Envelope failed;
    failed.mutable_refusal()->set_round(round);
    failed.mutable_refusal()->set_reason(update.status().message());
    failed.mutable_refusal()->set_stays(true);
    Send(failed);
    return;
  }
  ++rounds_trained_;
  // Under secure aggregation a lora site measures its adapter from the
  // global one, so the model goes only after.
  const bool secure = secagg_ && secagg_->round() == round;
  if (secure) SecAggTrained(std::move(update).value());
  if (!options_.keep_model) {
    model_.reset();
    model_version_ = 0;
    model_checksum_.clear();
  }
  if (secure || DropsAfterTraining(round, *update)) return;
  spdlog::info("{}: round {} trained on {} in {:.3f} s; uploading", name_, round, update->trained_on, update->seconds);
  if (update->local_steps > 0) spdlog::info("{}: round {}: {} local steps", name_, round, update->local_steps);
  auto payload = std::make_shared<const Update>(std::move(update).value());
  v1::Envelope envelope;
  auto* begin = envelope.mutable_update_begin();
  begin->set_round(round);
  begin->set_kind(payload->kind == UpdateKind::kLora ? v1::UPDATE_LORA : v1::UPDATE_FULL);
  begin->set_num_examples(payload->num_examples);
  begin->set_train_loss(payload->train_loss);
  *begin->mutable_manifest() = proto::ToProto(payload->manifest);
  begin->set_train_seconds(payload->seconds);
  begin->set_local_steps(payload->local_steps);
  begin->set_normalizer(payload->normalizer);
  begin->set_control_follows(!payload->control_delta.empty());
  begin->set_trained_from_version(round_->model_version());
  awaiting_answer_ = true;
  ArmRead();  // from here the server may read nothing from us until a staging slot frees
  Send(envelope);
  upload_ = payload;
  upload_round_ = round;
  upload_offset_ = 0;
  upload_digest_ = std::make_unique<crypto::TransferDigest>();
  if (payload->stream) {
    slice_ = {};
    slice_at_ = 0;
    std::weak_ptr<Agent> weak = weak_from_this();
    UpdateStream* raw = payload->stream.get();
    payload->stream->on_ready = [&io = io_, weak, raw] {
      asio::post(io, [weak, raw] {
        auto self = weak.lock();
        if (self && self->upload_ && self->upload_->stream.get() == raw) self->WriteNext();
      });
    };
    asio::post(training_, [stream = payload->stream] { stream->Run(); });
  }
  WriteNext();
}

void Agent::Discard(const std::shared_ptr<UpdateStream>& stream) {
  stream->Cancel();
  asio::post(training_, [stream] { stream->Run(); });
}

void Agent::DropUpload() {
  if (upload_ && upload_->stream) upload_->stream->Cancel();  // its producer, posted already, ends quickly
  upload_.reset();
  slice_ = {};
  upload_drop_at_ = UINT64_MAX;
}

void Agent::NextStreamChunk() {
  UpdateStream& stream = *upload_->stream;
  const uint64_t total = upload_->manifest.total_elements * sizeof(float);
  if (slice_at_ == slice_.values.size()) {
    UpdateStream::Slice next;
    Status end;
    switch (stream.Pop(&next, &end)) {
      case UpdateStream::Next::kPending: return;  // on_ready calls WriteNext again
      case UpdateStream::Next::kSlice:
        if (next.offset * sizeof(float) != upload_offset_ || next.values.empty() ||
            upload_offset_ + next.values.size() * sizeof(float) > total) {
          spdlog::error("{}: round {}: the update's stream gave a slice at element {} (+{}) where {} was due", name_,
                        upload_round_, next.offset, next.values.size(), upload_offset_ / sizeof(float));
          return Disconnected("the update stream broke");
        }
        slice_ = std::move(next);
        slice_at_ = 0;
        break;
      case UpdateStream::Next::kEnd:
        if (!end.ok() || upload_offset_ != total) {
          const std::string reason = end.ok() ? fmt::format("it ended after {} of {} bytes", upload_offset_, total)
                                              : end.ToString();
          spdlog::error("{}: round {}: the update stream failed: {}", name_, upload_round_, reason);
          return Disconnected("the update stream failed");
        }
        v1::Envelope envelope;
        envelope.mutable_update_commit()->set_round(upload_round_);
        envelope.mutable_update_commit()->set_digest(upload_digest_->FinalHex());
        upload_.reset();
        upload_digest_.reset();
        slice_ = {};
        outbox_.push_back(std::make_shared<const proto::Frame>(proto::EncodeFrame(envelope)));
        return;
    }
  }
  const uint64_t elements = std::min<uint64_t>(std::max<uint32_t>(chunk_bytes_ / sizeof(float), 1),
                                               slice_.values.size() - slice_at_);
  const char* bytes = reinterpret_cast<const char*>(slice_.values.data() + slice_at_);
  const uint64_t size = elements * sizeof(float);
  outbox_.push_back(std::make_shared<const proto::Frame>(
      proto::EncodeUpdateChunk(upload_round_, upload_offset_, v1::DTYPE_F32, bytes, size)));
  upload_digest_->Update(bytes, size);
  upload_offset_ += size;
  slice_at_ += elements;
}

void Agent::Send(const v1::Envelope& envelope) {
  outbox_.push_back(std::make_shared<const proto::Frame>(proto::EncodeFrame(envelope)));
  WriteNext();
}

void Agent::WriteNext() {
  if (writing_ || !stream_ || DropsMidUpload()) return;
  if (outbox_.empty() && upload_ && upload_->stream) {
    NextStreamChunk();
  } else if (outbox_.empty() && upload_) {
    // The delta, then SCAFFOLD's Δc_i past its end; no chunk holds both.
    const uint64_t delta = upload_->payload.size() * sizeof(float);
    const uint64_t total = delta + upload_->control_delta.size() * sizeof(float);
    if (upload_offset_ < total) {
      const bool in_delta = upload_offset_ < delta;
      const uint64_t end = std::min(in_delta ? delta : total, upload_drop_at_);  // a simulated dropout cuts it
      const uint64_t size = std::min<uint64_t>(chunk_bytes_, end - upload_offset_);
      const char* bytes = in_delta ? reinterpret_cast<const char*>(upload_->payload.data()) + upload_offset_
                                   : reinterpret_cast<const char*>(upload_->control_delta.data()) +
                                         (upload_offset_ - delta);
      outbox_.push_back(std::make_shared<const proto::Frame>(
          proto::EncodeUpdateChunk(upload_round_, upload_offset_, v1::DTYPE_F32, bytes, size)));
      upload_digest_->Update(bytes, size);  // while the bytes are in cache
      upload_offset_ += size;
    } else {
      v1::Envelope envelope;
      envelope.mutable_update_commit()->set_round(upload_round_);
      envelope.mutable_update_commit()->set_digest(upload_digest_->FinalHex());
      upload_.reset();
      upload_digest_.reset();
      outbox_.push_back(std::make_shared<const proto::Frame>(proto::EncodeFrame(envelope)));
    }
  }
  if (outbox_.empty()) return;
  writing_ = true;
  auto frame = outbox_.front();
  const uint64_t connection = connection_;
  write_timer_.expires_at(Patience(options_.write_timeout_s));
  write_timer_.async_wait([self = shared_from_this(), connection, bytes = frame->size()](const error_code& ec) {
    if (ec || connection != self->connection_ || self->stopped_ || !Due(self->write_timer_)) return;
    self->Disconnected(fmt::format("write to {}: a frame of {} bytes not taken in {} s", self->Peer(), bytes,
                                   self->options_.write_timeout_s));
  });
  asio::async_write(*stream_, asio::buffer(frame->data(), frame->size()), [self = shared_from_this(), frame, connection, stream = stream_](const error_code& ec, size_t) {
    if (connection != self->connection_ || self->stopped_) return;
    Disarm(self->write_timer_);
    self->writing_ = false;
    self->outbox_.pop_front();
    // A peer that is gone (reset, or closed: EPIPE) may have said why before
    // it closed (a TLS alert, an Error frame) in bytes not read yet; the read
    // always pending on a connected agent takes them, then ends the
    // connection itself. Disconnecting here would drop them unread.
    if (ec == asio::error::broken_pipe || ec == asio::error::connection_reset) return;
    if (ec) return self->Disconnected(ec.message());
    if (self->secagg_upload_) self->MaskNextSecAggFrame();  // the masked input's next frame, as the socket drains
    self->WriteNext();
  });
}

void Agent::Heartbeat() {
  heartbeat_timer_.expires_after(std::chrono::milliseconds(heartbeat_ms_));
  const uint64_t connection = connection_;
  heartbeat_timer_.async_wait([self = shared_from_this(), connection](const error_code& ec) {
    if (ec || connection != self->connection_ || self->stopped_) return;
    v1::Envelope envelope;
    envelope.mutable_heartbeat()->set_sent_unix_ms(
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count());
    self->Send(envelope);
    self->Heartbeat();
  });
}

void Agent::Disconnected(const std::string& reason) {
  if (stopped_) return;
  // A refusal ends with the server closing the connection once it has read
  // it (closing first could reset the connection and lose it).
  if (finish_when_written_) return Finish(*finish_when_written_);
  ++connection_;  // every handler of the old connection is now stale
  heartbeat_timer_.cancel();
  stage_timer_.cancel();
  read_timer_.cancel();
  write_timer_.cancel();
  if (stream_) {
    error_code ignored;
    stream_->lowest_layer().close(ignored);
  }
  // One drop is routine (a restarted server); a site that keeps failing to
  // get through says so even at the simulator's default warn level.
  spdlog::log(failures_ >= 3 ? spdlog::level::warn : spdlog::level::info, "{}: disconnected ({} in a row): {}",
              name_.empty() ? options_.label : name_, failures_ + 1, reason);
  ScheduleReconnect();
}

void Agent::ScheduleReconnect() {
  // Exponential backoff with jitter, so a restarted server is not stormed.
  const double base = std::min(options_.max_backoff_s, options_.initial_backoff_s * std::pow(2.0, failures_));
  ++failures_;
  std::mt19937_64 rng(std::random_device{}());
  const double delay = base * (0.5 + 0.5 * double(rng() >> 11) * 0x1.0p-53);
  reconnect_timer_.expires_after(std::chrono::milliseconds(int64_t(delay * 1000)));
  reconnect_timer_.async_wait([self = shared_from_this()](const error_code& ec) {
    if (!ec) self->Connect();
  });
}

// Reconnecting cannot help a revoked certificate: the site stops and says why.
void Agent::Revoked(const std::string& detail) {
  Finish(FailedPrecondition("{}: the federation revoked this site's certificate ({}); it needs a new one from the "
                            "federation's operator",
                            name_.empty() ? options_.label : name_, detail));
}

void Agent::Finish(const Status& status) {
  if (finished_) return;
  finished_ = true;
  Stop();
  if (on_finished) on_finished(status);
}

}  // namespace estuary::client
