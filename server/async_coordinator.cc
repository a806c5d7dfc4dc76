#include "server/async_coordinator.h"

#include <algorithm>
#include <limits>

#include <spdlog/spdlog.h>

#include "aggregation/fedbuff.h"
#include "aggregation/sampling.h"
#include "base/seed.h"
#include "crypto/transfer_digest.h"
#include "proto/frame.h"
#include "server/recover.h"
#include "server/round_messages.h"
#include "server/update_checks.h"

namespace estuary::server {

namespace asio = boost::asio;
using SteadyClock = std::chrono::steady_clock;

AsyncCoordinator::AsyncCoordinator(const ServerConfig& config, Store& store, Clock& clock, asio::any_io_executor io,
                                   asio::any_io_executor worker)
    : config_(config),
      store_(store),
      clock_(clock),
      io_(std::move(io)),
      worker_(std::move(worker)),
      distribution_(clock, std::chrono::milliseconds(int64_t(config.download_slot_timeout_s * 1000))),
      slots_(config.staging_slots, config.staging_memory_bytes, config.spill_dir) {}

AsyncCoordinator::~AsyncCoordinator() = default;

void AsyncCoordinator::LogIfError(const Status& status, const char* what) {
  if (!status.ok()) spdlog::error("{}: {}", what, status.ToString());
}

Status AsyncCoordinator::Recover() {
  ESTUARY_ASSIGN_OR_RETURN(aggregation::StalenessWeight weight,
                           aggregation::ParseStalenessWeight(config_.async.staleness_weight));
  ESTUARY_ASSIGN_OR_RETURN(RecoveredFederation recovered, RecoverFederation(config_, store_));
  task_ = std::move(recovered.task);
  manifest_ = std::move(recovered.manifest);
  distribution_.SetHeldBase(std::move(recovered.held_base));
  aggregator_ = std::move(recovered.aggregator);
  version_ = recovered.model.version;
  const double server_lr = config_.federation.strategy().server_lr();
  const aggregation::FedBuffOptions options{
      .buffer = config_.async.buffer,
      .server_lr = server_lr > 0 ? server_lr : 1.0,
      .weight = weight,
      .max_staleness = config_.async.max_staleness < 0 ? std::numeric_limits<uint64_t>::max()
                                                       : uint64_t(config_.async.max_staleness)};
  // Before anything is posted: the worker is not running for us yet.
  ESTUARY_RETURN_IF_ERROR(aggregator_->BeginAsync(options, version_, recovered.model.values, config_.rounds));
  distribution_.Reset(manifest_, recovered.model);
  distribution_.BeginRound(version_ + 1);
  spdlog::info("{} asynchronous federation {} at model version {} ({} parameters), checksum {}: K = {}, staleness "
               "weight {}, max staleness {}, concurrency {}",
               recovered.last ? "resumed" : "new", recovered.federation_id, version_, manifest_.total_elements,
               recovered.model.checksum.substr(0, 12), options.buffer, weight.ToString(),
               config_.async.max_staleness < 0 ? std::string("none") : std::to_string(config_.async.max_staleness),
               config_.async.concurrency == 0 ? std::string("every site") : std::to_string(config_.async.concurrency));
  if (!recovered.custom_description.empty()) spdlog::info("{}", recovered.custom_description);
  return Status::Ok();
}

void AsyncCoordinator::OnHello(const std::shared_ptr<ClientSession>& session, const v1::Hello& hello) {
  const std::string& name = session->name();
  auto it = connected_.find(name);
  if (it != connected_.end() && it->second != session) {
    auto old = it->second;
    connected_.erase(it);
    EndWork(name, "replaced by a new connection");
    old->SendErrorAndClose(v1::Error::REPLACED,
                           fmt::format("a new connection from {} replaced this one", session->address()));
  }
  connected_[name] = session;
  if (metrics_) metrics_->SetConnectedSites(connected_.size());
  distribution_.OnHello(name, hello);
  LogIfError(store_.ClientSeen(name, session->address(), clock_.UnixMs()), "store");
  spdlog::info("client {} connected from {} ({} connected)", name, session->address(), connected_.size());
  session->Send(WelcomeMessage(name, config_));
  if (complete()) {
    session->Send(FederationCompleteMessage(version_, distribution_.current()));
    late_sites_.Told(name);
  }
  if (closing_) return session->CloseAfterWrites();
  MaybeAssign();
}

void AsyncCoordinator::OnMessage(const std::shared_ptr<ClientSession>& session, v1::Envelope envelope) {
  switch (envelope.body_case()) {
    case v1::Envelope::kUpdateBegin: return OnUpdateBegin(session, envelope.update_begin());
    case v1::Envelope::kUpdateChunk: return OnUpdateChunk(session, envelope.update_chunk());
    case v1::Envelope::kUpdateCommit: return OnUpdateCommit(session, envelope.update_commit());
    case v1::Envelope::kRefusal: return OnRefusal(session, envelope.refusal());
    default:
      return Reject(session, v1::Error::BAD_MESSAGE,
                    fmt::format("a client of an asynchronous federation may not send {}", proto::BodyName(envelope)));
  }
}

bool AsyncCoordinator::BeginVersion() {
  record_ = RoundRecord{};
  record_.round = version_ + 1;
  record_.started_ms = clock_.UnixMs();
  record_.strategy = "fedbuff";
  if (Status begun = store_.BeginRound(record_); !begun.ok()) {
    Halt(fmt::format("cannot record version {}: {}", record_.round, begun.ToString()));
    return false;
  }
  LogIfError(store_.Transition(record_.round, RoundState::kOpen, RoundState::kCollecting, clock_.UnixMs()), "store");
  record_.state = RoundState::kCollecting;
  version_started_ = clock_.Now();
  arrivals_ = 0;
  loss_sum_ = examples_sum_ = 0;
  stale_ = 0;
  if (metrics_) metrics_->SetCurrentRound(record_.round);
  return true;
}

void AsyncCoordinator::MaybeAssign() {
  if (closing_ || halted_ || complete()) return;
  if (!started_) {
    if (connected_.size() < config_.min_clients) return;
    if (!BeginVersion()) return;
    started_ = true;
  }
  const size_t places = config_.async.concurrency == 0 ? connected_.size() : config_.async.concurrency;
  if (work_.size() >= places) return;
  std::vector<std::string> idle;
  for (const auto& [name, session] : connected_) {
    if (!work_.contains(name)) idle.push_back(name);
  }
  if (idle.empty()) return;
  const size_t k = std::min(places - work_.size(), idle.size());
  // Each draw its own seed: the same one would draw the same sites every time.
  const uint64_t seed = MixSeed(task_.seed(), ++draws_);
  for (const std::string& name : aggregation::SampleClients(std::move(idle), k, seed, version_ + 1)) Assign(name);
  distribution_.StreamQueued();
  if (metrics_) metrics_->SetSelectedSites(work_.size());
}

void AsyncCoordinator::Assign(const std::string& name) {
  auto session = connected_.at(name);
  const int64_t deadline_ms = clock_.UnixMs() + int64_t(config_.round_deadline_s * 1000);
  v1::Envelope envelope = RoundStartMessage(version_ + 1, distribution_.current(), manifest_, task_, deadline_ms);
  envelope.mutable_round_start()->set_asynchronous(true);
  const uint64_t bytes_down = distribution_.Offer(session, envelope.mutable_round_start());
  session->Send(envelope);
  record_.bytes_down += bytes_down;
  ++record_.clients_selected;  // work sent while this version was built
  Work& w = work_[name];
  w.session = session;
  w.id = ++next_work_;
  w.round = version_ + 1;
  w.from = version_;
  w.started = clock_.Now();
  w.deadline = clock_.MakeTimer();
  w.deadline->Arm(std::chrono::milliseconds(int64_t(config_.round_deadline_s * 1000)), [this, name, id = w.id] {
    auto it = work_.find(name);
    if (it == work_.end() || it->second.id != id || it->second.state == Work::State::kFolding) return;
    spdlog::info("version {}: {} sent no update within {} s of its model version {}", version_ + 1, name,
                 config_.round_deadline_s, it->second.from);
    EndWork(name, fmt::format("late: no update within {} s of model version {}", config_.round_deadline_s,
                              it->second.from));
    if (auto s = connected_.find(name); s != connected_.end()) s->second->Resume();
    MaybeAssign();
  });
  spdlog::debug("version {}: {} trains from version {}", version_ + 1, name, version_);
}

AsyncCoordinator::Work* AsyncCoordinator::OpenWork(const std::shared_ptr<ClientSession>& session) {
  auto it = work_.find(session->name());
  if (it == work_.end() || it->second.session.lock() != session || it->second.state == Work::State::kFolding) {
    return nullptr;
  }
  return &it->second;
}

void AsyncCoordinator::OnUpdateBegin(const std::shared_ptr<ClientSession>& session, const v1::UpdateBegin& begin) {
  const std::string& name = session->name();
  Work* w = OpenWork(session);
  if (!w) return Reject(session, v1::Error::NOT_SELECTED, fmt::format("{} has no work out to upload", name));
  if (begin.round() != w->round) {
    return Reject(session, v1::Error::ROUND_NOT_OPEN,
                  fmt::format("update for round {} but {} was sent work for version {}", begin.round(), name, w->round));
  }
  if (w->state != Work::State::kTraining) {
    return Reject(session, v1::Error::DUPLICATE_UPDATE, fmt::format("second update from {} for its work", name));
  }
  if (!begin.has_trained_from_version()) {
    return Reject(session, v1::Error::BAD_MESSAGE,
                  "an asynchronous federation needs the version an update trained from (trained_from_version): "
                  "this site predates asynchronous rounds");
  }
  if (begin.trained_from_version() != w->from) {
    return Reject(session, v1::Error::BAD_MESSAGE,
                  fmt::format("update trained from version {}, but {} was given version {}",
                              begin.trained_from_version(), name, w->from));
  }
  // It trains only on a model whose checksum it verified: it holds that version now.
  distribution_.Confirm(name);
  auto layout = CheckUpdateBegin(begin, name, task_.update_kind(), config_.federation.limits(), manifest_, lora_);
  if (!layout.ok()) return Reject(session, v1::Error::BAD_MESSAGE, layout.status().message());
  w->begin = begin;
  w->layout = std::move(layout).value();
  w->state = Work::State::kUploading;
  Status staged = slots_.Begin(session, w->layout);
  if (!staged.ok()) return Reject(session, v1::Error::SERVER_BUSY, staged.message());
}

void AsyncCoordinator::OnUpdateChunk(const std::shared_ptr<ClientSession>& session, const v1::UpdateChunk& chunk) {
  Work* w = OpenWork(session);
  if (!w || w->state != Work::State::kUploading || chunk.round() != w->round) {
    return Reject(session, v1::Error::ROUND_NOT_OPEN,
                  fmt::format("update chunk for round {}, which has no open upload from this client", chunk.round()));
  }
  StagedUpdate* staged = slots_.Staged(session->name());
  if (!staged) return Reject(session, v1::Error::BAD_MESSAGE, "update chunk before its upload was staged");
  Status appended = staged->Append(chunk.offset(), chunk.dtype(), chunk.data());
  if (!appended.ok()) return Reject(session, v1::Error::BAD_CHUNK, appended.message());
}

void AsyncCoordinator::OnUpdateCommit(const std::shared_ptr<ClientSession>& session, const v1::UpdateCommit& commit) {
  const std::string& name = session->name();
  Work* w = OpenWork(session);
  if (!w || w->state != Work::State::kUploading || commit.round() != w->round || !slots_.Staged(name)) {
    return Reject(session, v1::Error::ROUND_NOT_OPEN,
                  fmt::format("update commit for round {}, which has no open upload from this client", commit.round()));
  }
  if (commit.digest().size() != crypto::kTransferDigestHexDigits) {
    return Reject(session, v1::Error::BAD_MESSAGE,
                  fmt::format("update digest has {} characters; an XXH3-128 hex digest has {}", commit.digest().size(),
                              crypto::kTransferDigestHexDigits));
  }
  Status committed = slots_.Staged(name)->Commit(commit.digest());
  if (!committed.ok()) return Reject(session, v1::Error::CHECKSUM_MISMATCH, committed.message());
  std::shared_ptr<StagedUpdate> staged = slots_.TakeForFold(name);
  w->state = Work::State::kFolding;
  w->deadline->Cancel();
  w->bytes_up = staged->received_bytes();
  asio::post(worker_, [this, staged, name, examples = w->begin.num_examples(), from = w->from] {
    const auto start = SteadyClock::now();
    Aggregator::AsyncFolded folded = aggregator_->FoldAsync(staged->values(), examples, from);
    if (metrics_ && folded.status.ok()) {
      metrics_->Folded(staged->values().size() * sizeof(float),
                       std::chrono::duration<double>(SteadyClock::now() - start).count());
    }
    asio::post(io_, [this, name, folded = std::move(folded)]() mutable { OnFolded(name, std::move(folded)); });
  });
}

void AsyncCoordinator::OnFolded(const std::string& name, Aggregator::AsyncFolded folded) {
  slots_.FoldDone();
  auto it = work_.find(name);
  if (it == work_.end()) return;  // cannot be: work in kFolding ends only here
  Work w = std::move(it->second);
  work_.erase(it);
  if (complete() || halted_) {  // folded by nothing: the last version was committed before it came
    if (auto session = w.session.lock(); session && !session->closed()) {
      session->Send(UpdateAckMessage(w.round, folded.status));
    }
    return;
  }
  Arrival a{.round = record_.round,
            .seq = ++arrivals_,
            .client = name,
            .status = "folded",
            .trained_from = w.from,
            .staleness = folded.staleness,
            .weight = folded.weight,
            .examples = w.begin.num_examples(),
            .train_loss = w.begin.train_loss(),
            .bytes_up = w.bytes_up,
            .seconds = std::chrono::duration<double>(clock_.Now() - w.started).count(),
            .at_ms = clock_.UnixMs(),
            .detail = folded.status.ok() ? folded.note : folded.status.message()};
  if (folded.version + 1 != record_.round) {
    spdlog::critical("version {}: {}'s update was folded at version {}", record_.round, name, folded.version);
  }
  if (folded.status.ok()) {
    ++record_.updates_received;
    record_.bytes_up += w.bytes_up;
    loss_sum_ += a.train_loss * double(a.examples);
    examples_sum_ += double(a.examples);
    if (!folded.note.empty()) spdlog::warn("version {}: update from {}: {}", record_.round, name, folded.note);
  } else if (folded.stale) {
    a.status = "stale";
    ++stale_;
    spdlog::warn("version {}: update from {} refused: {}", record_.round, name, folded.status.message());
  } else {
    a.status = "rejected";
    spdlog::warn("version {}: update from {} rejected: {}", record_.round, name, folded.status.message());
  }
  LogIfError(store_.RecordArrival(a), "store");
  if (auto session = w.session.lock(); session && !session->closed()) {
    session->Send(UpdateAckMessage(w.round, folded.status));
  }
  if (folded.step) Commit(std::move(*folded.step));
  GrantSlots();
  MaybeAssign();
}

void AsyncCoordinator::Commit(Aggregator::Finished step) {
  if (!step.status.ok()) return Halt(fmt::format("version {}: {}", record_.round, step.status.ToString()));
  LogIfError(store_.Transition(record_.round, RoundState::kCollecting, RoundState::kAggregating, clock_.UnixMs()),
             "store");
  record_.ended_ms = clock_.UnixMs();
  record_.model_version = record_.round;
  record_.global_checksum = step.model.checksum;
  record_.train_loss = examples_sum_ > 0 ? loss_sum_ / examples_sum_ : 0;
  if (step.eval) {
    record_.test_accuracy = step.eval->accuracy;
    record_.test_loss = step.eval->loss;
  }
  record_.detail = fmt::format("fedbuff K={} staleness weight {}: {} folded, {} refused as stale, of {} arrivals",
                               config_.async.buffer, config_.async.staleness_weight, record_.updates_received, stale_,
                               arrivals_);
  record_.state = RoundState::kCommitted;
  if (Status committed = store_.CommitRound(record_, step.checkpoint, clock_.UnixMs()); !committed.ok()) {
    return Halt(fmt::format("cannot commit version {} to the round log: {}", record_.round, committed.ToString()));
  }
  // The checkpointer is the worker's: its marker follows the write the worker already did.
  asio::post(worker_, [this, version = record_.round] {
    LogIfError(aggregator_->MarkCommitted(version), "checkpoint directory");
  });
  version_ = record_.round;
  step.model.version = version_;
  distribution_.Publish(std::move(step.model), {});
  const double seconds = std::chrono::duration<double>(clock_.Now() - version_started_).count();
  if (metrics_) metrics_->RoundEnded(RoundState::kCommitted, seconds);
  if (events_) {
    LogIfError(events_->WriteScalars(int64_t(version_), {{"round/train_loss", record_.train_loss},
                                                        {"round/updates_received", double(record_.updates_received)},
                                                        {"round/seconds", seconds}}),
               "tensorboard");
  }
  spdlog::info("version {} committed: {} updates, train loss {:.4f}{}, {:.3f} s", version_, record_.updates_received,
               record_.train_loss,
               step.eval ? fmt::format(", test accuracy {:.4f}", step.eval->accuracy) : std::string(), seconds);
  if (!complete()) {
    BeginVersion();
    return;
  }
  spdlog::info("federation complete after {} versions", version_);
  LogIfError(store_.SetMeta("complete", std::to_string(version_)), "store");
  SendToAll(connected_, FederationCompleteMessage(version_, distribution_.current()));
  // Unlike a round's end, sites are busy here: one may be writing an upload
  // that crossed the message. Closing under it would break its pipe before
  // it reads that the federation is over, so the sites leave first (each
  // does once it has read it), within idle_timeout.
  finishing_ = true;
  finish_timer_ = clock_.MakeTimer();
  finish_timer_->Arm(std::chrono::milliseconds(int64_t(config_.idle_timeout_s * 1000)), [this] {
    spdlog::info("{} sites still connected {} s after the federation completed", connected_.size(),
                 config_.idle_timeout_s);
    Finish();
  });
  MaybeFinish();
}

void AsyncCoordinator::TellLateSites() {
  late_sites_.Start(SitesInRoundLog(store_), clock_, LateSites::Limit(config_.idle_timeout_s), on_complete_);
}

void AsyncCoordinator::MaybeFinish() {
  if (finishing_ && connected_.empty()) Finish();
}

void AsyncCoordinator::Finish() {
  if (!finishing_) return;
  finishing_ = false;
  if (finish_timer_) finish_timer_->Cancel();
  if (on_complete_) on_complete_();
}

void AsyncCoordinator::EndWork(const std::string& name, const std::string& why) {
  auto it = work_.find(name);
  if (it == work_.end() || it->second.state == Work::State::kFolding) return;
  slots_.Release(name);  // a partial upload is discarded here, unread
  LogIfError(store_.RecordEvent({clock_.UnixMs(), "work_ended", name,
                                 fmt::format("version {} (from {}): {}", record_.round, it->second.from, why)}),
             "store");
  work_.erase(it);
  GrantSlots();
}

void AsyncCoordinator::Reject(const std::shared_ptr<ClientSession>& session, v1::Error::Code code,
                              const std::string& message) {
  spdlog::warn("rejected {} ({}): {}", session->name(), session->address(), message);
  if (metrics_) metrics_->UploadRejected(code);
  LogIfError(store_.RecordEvent({clock_.UnixMs(), "update_rejected", session->name() + "@" + session->address(),
                                 fmt::format("{}: {}", v1::Error::Code_Name(code), message)}),
             "store");
  if (OpenWork(session)) EndWork(session->name(), "rejected: " + message);
  session->SendErrorAndClose(code, message);
  MaybeAssign();
}

void AsyncCoordinator::OnRefusal(const std::shared_ptr<ClientSession>& session, const v1::SiteRefusal& refusal) {
  std::string reason = refusal.reason().substr(0, 1024);  // one line, bounded: the peer's text
  std::replace(reason.begin(), reason.end(), '\n', ' ');
  spdlog::warn("client {} {} its work: {}", session->name(), refusal.stays() ? "failed" : "refused", reason);
  LogIfError(store_.RecordEvent({clock_.UnixMs(), refusal.stays() ? "site_failed" : "site_refused",
                                 session->name() + "@" + session->address(),
                                 fmt::format("round {}: {}", refusal.round(), reason)}),
             "store");
  if (OpenWork(session)) EndWork(session->name(), (refusal.stays() ? "failed: " : "refused: ") + reason);
  // A refusing site leaves; one that failed is idle, and may be drawn again.
  if (!refusal.stays()) session->CloseAfterWrites();
  MaybeAssign();
}

void AsyncCoordinator::OnClosed(ClientSession& session) {
  auto it = connected_.find(session.name());
  if (it == connected_.end() || it->second.get() != &session) return;
  auto held = it->second;
  if (OpenWork(held)) EndWork(session.name(), "connection lost");
  connected_.erase(it);
  if (metrics_) metrics_->SetConnectedSites(connected_.size());
  MaybeAssign();
  MaybeFinish();
}

void AsyncCoordinator::GrantSlots() {
  for (const auto& [session, why] : slots_.Grant()) Reject(session, v1::Error::SERVER_BUSY, why.message());
}

void AsyncCoordinator::Halt(const std::string& reason) {
  // The model the worker holds may be ahead of the log now: a restart resumes from the log's last version.
  spdlog::critical("asynchronous federation halted: {}; a restart resumes from version {}", reason, version_);
  halted_ = true;
  if (record_.round > version_) LogIfError(store_.FailRound(record_.round, reason, clock_.UnixMs()), "store");
  CloseAll();
}

void AsyncCoordinator::CloseAll() {
  closing_ = true;
  for (auto& [name, w] : work_) {
    if (w.deadline) w.deadline->Cancel();
  }
  CloseAllAfterWrites(connected_);
}

std::vector<std::shared_ptr<ClientSession>> AsyncCoordinator::Connected() const { return SessionsOf(connected_); }

}  // namespace estuary::server
