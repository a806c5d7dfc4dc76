#include "server/coordinator.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "aggregation/robust_strategy.h"
#include "aggregation/sampling.h"
#include "base/seed.h"
#include "crypto/sha256.h"
#include "crypto/transfer_digest.h"
#include "proto/frame.h"
#include "aggregation/federation.h"
#include "secagg/wire.h"
#include "server/round_messages.h"
#include "server/update_checks.h"

namespace estuary::server {

namespace {
// A failed try's event detail begins "round R try ", then its number.
std::string FailedTryPrefix(uint64_t round) { return fmt::format("round {} try ", round); }

// What TensorBoard plots of a committed round (serve --tensorboard).
std::map<std::string, double> RoundScalars(const RoundRecord& r, double seconds) {
  std::map<std::string, double> out = {{"round/train_loss", r.train_loss},
                                       {"round/updates_received", double(r.updates_received)},
                                       {"round/sites_selected", double(r.clients_selected)},
                                       {"round/seconds", seconds},
                                       {"round/bytes_up", double(r.bytes_up)},
                                       {"round/bytes_down", double(r.bytes_down)}};
  if (r.test_accuracy) out["eval/accuracy"] = *r.test_accuracy;
  if (r.test_loss) out["eval/loss"] = *r.test_loss;
  if (r.privacy) out["privacy/epsilon"] = r.privacy->epsilon;
  return out;
}
}  // namespace

namespace asio = boost::asio;
using SteadyClock = std::chrono::steady_clock;

Coordinator::Coordinator(const ServerConfig& config, Store& store, Clock& clock, asio::any_io_executor io,
                         asio::any_io_executor worker)
    : config_(config),
      store_(store),
      clock_(clock),
      io_(std::move(io)),
      worker_(std::move(worker)),
      deadline_(clock.MakeTimer()),
      retry_(clock.MakeTimer()),
      eval_deadline_(clock.MakeTimer()),
      distribution_(clock, std::chrono::milliseconds(int64_t(config.download_slot_timeout_s * 1000))),
      // A robust rule keeps a round's staged updates until it commits: on
      // disk, mapped, rather than in memory.
      slots_(config.staging_slots,
             aggregation::IsRobustStrategy(config.federation.strategy().name()) ? 0 : config.staging_memory_bytes,
             config.spill_dir) {}

Coordinator::~Coordinator() = default;

void Coordinator::LogIfError(const Status& status, const char* what) {
  if (!status.ok()) spdlog::error("{}: {}", what, status.ToString());
}

double Coordinator::SecondsSince(SteadyClock::time_point start) const {
  return std::chrono::duration<double>(clock_.Now() - start).count();
}

Status Coordinator::CountFailedTries() {
  // A retry replaces the round's row and transitions; the events stay.
  ESTUARY_ASSIGN_OR_RETURN(const uint64_t failed, store_.CountEvents("round_failed", FailedTryPrefix(round_)));
  failed_tries_ = uint32_t(failed);
  return Status::Ok();
}

void Coordinator::OnHello(const std::shared_ptr<ClientSession>& session, const v1::Hello& hello) {
  const std::string& name = session->name();
  auto it = connected_.find(name);
  if (it != connected_.end() && it->second != session) {
    auto old = it->second;
    connected_.erase(it);
    old->SendErrorAndClose(v1::Error::REPLACED, fmt::format("a new connection from {} replaced this one",
                                                            session->address()));
  }
  connected_[name] = session;
  if (metrics_) metrics_->SetConnectedSites(connected_.size());
  distribution_.OnHello(name, hello);
  hello_examples_[name] = hello.num_examples();
  if (hello.evaluates()) {
    evaluators_.insert(name);
  } else {
    evaluators_.erase(name);
  }
  LogIfError(store_.ClientSeen(name, session->address(), clock_.UnixMs()), "store");
  // Until round 1 opens, the operator's question is how many are still missing.
  const bool waiting = !round_running_ && !complete() && connected_.size() < config_.min_clients;
  spdlog::info("client {} connected from {} ({} connected{})", name, session->address(), connected_.size(),
               waiting ? fmt::format("; waiting for {} more before round {} opens", config_.min_clients -
                                                                                      connected_.size(), round_)
                       : "");

  session->Send(WelcomeMessage(name, config_));
  if (complete()) {
    session->Send(FederationCompleteMessage(round_ - 1, distribution_.current()));
    late_sites_.Told(name);
  }
  if (closing_) return session->CloseAfterWrites();
  if (!complete()) MaybeStartRound();
}

void Coordinator::OnMessage(const std::shared_ptr<ClientSession>& session, v1::Envelope envelope) {
  switch (envelope.body_case()) {
    case v1::Envelope::kUpdateBegin: return OnUpdateBegin(session, envelope.update_begin());
    case v1::Envelope::kUpdateChunk: return OnUpdateChunk(session, envelope.update_chunk());
    case v1::Envelope::kUpdateCommit: return OnUpdateCommit(session, envelope.update_commit());
    case v1::Envelope::kRefusal: return OnRefusal(session, envelope.refusal());
    case v1::Envelope::kEvalReport: return OnEvalReport(session, envelope.eval_report());
    case v1::Envelope::kSecaggAdvertise:
    case v1::Envelope::kSecaggShares:
    case v1::Envelope::kSecaggMaskedChunk:
    case v1::Envelope::kSecaggMaskedDone:
    case v1::Envelope::kSecaggSurvivorsSigned:
    case v1::Envelope::kSecaggUnmaskResponse: return OnSecAgg(session, envelope);
    default:
      return Reject(session, v1::Error::BAD_MESSAGE,
                    fmt::format("a client may not send {}", proto::BodyName(envelope)));
  }
}

void Coordinator::MaybeStartRound() {
  if (closing_ || round_running_ || eval_ || complete() || connected_.size() < config_.min_clients) return;
  StartRound();
}

void Coordinator::StartRound() {
  std::vector<std::string> names;
  for (const auto& [name, session] : connected_) names.push_back(name);
  std::vector<std::string> selected;
  if (!DrawSites(names, &selected)) return;
  if (!WithinPrivacyBudget(selected.size(), names.size())) return;

  record_ = RoundRecord{};
  record_.round = round_;
  record_.state = RoundState::kOpen;
  record_.started_ms = clock_.UnixMs();
  record_.strategy = std::string(aggregator_->name());
  record_.clients_selected = static_cast<uint32_t>(selected.size());
  Status begun = store_.BeginRound(record_);
  if (!begun.ok()) {
    spdlog::critical("cannot record round {}: {}", round_, begun.ToString());
    return;
  }
  state_ = RoundState::kOpen;
  round_running_ = true;
  deadline_passed_ = false;
  round_started_ = clock_.Now();
  participants_.clear();
  slots_.Reset();
  distribution_.BeginRound(round_);
  loss_sum_ = examples_sum_ = 0;
  const GlobalModel& global = distribution_.current();
  // Poisson sampling under DP-FedAvg: the fixed denominator is the expected q · total_sites.
  const double expected =
      config_.sample_rate > 0 ? config_.sample_rate * double(config_.federation.strategy().total_sites()) : 0;
  asio::post(worker_, [this, round = round_, values = global.values, sampled = selected.size(), expected] {
    Status status = aggregator_->Begin(round, *values, sampled, expected);
    if (!status.ok()) spdlog::critical("strategy begin: {}", status.ToString());
  });

  secagg_.reset();
  if (config_.secagg.on) {
    if (Status s = StartSecAgg(selected); !s.ok()) return FailRound(s.message());
  }
  const int64_t deadline_ms = clock_.UnixMs() + int64_t(config_.round_deadline_s * 1000);
  v1::Envelope envelope = RoundStartMessage(round_, global, manifest_, task_, deadline_ms);
  for (const auto& name : selected) {
    auto session = connected_.at(name);
    if (secagg_) {
      const uint32_t id = secagg_->ids.at(name);
      const RoundSecAgg& r = secagg_->record;
      *envelope.mutable_round_start()->mutable_secagg() =
          secagg::ToProto(secagg_->server.config(), id, r.clip, r.scale, secagg_->weights[id]);
      if (secagg_->dp) {  // the site's share of the noise: what it adds before masking
        v1::SecAggSetup& setup = *envelope.mutable_round_start()->mutable_secagg();
        setup.set_dp_share_variance(secagg_->dp->site_variance);
        setup.set_dp_noise_multiplier(config_.federation.dp().noise_multiplier());
        setup.set_dp_min_inputs(secagg_->dp->min_included);
      }
    }
    const uint64_t bytes_down = distribution_.Offer(session, envelope.mutable_round_start());
    session->Send(envelope);
    Participant& p = participants_[name];
    p.session = session;
    p.started = clock_.Now();
    p.record.round = round_;
    p.record.client = name;
    p.record.status = "selected";
    p.record.bytes_down = bytes_down;
    record_.bytes_down += p.record.bytes_down;
    LogIfError(store_.UpsertParticipation(p.record), "store");
  }
  distribution_.StreamQueued();
  if (metrics_) {
    metrics_->SetCurrentRound(round_);
    metrics_->SetSelectedSites(selected.size());
  }
  spdlog::info("round {} open{}: {} of {} connected clients selected", round_,
               failed_tries_ > 0 ? fmt::format(" (try {})", failed_tries_ + 1) : std::string(), selected.size(),
               names.size());
  Transition(RoundState::kCollecting);
  deadline_->Arm(std::chrono::milliseconds(int64_t(config_.round_deadline_s * 1000)), [this, round = round_] {
    if (round_running_ && round_ == round && state_ == RoundState::kCollecting) OnDeadline();
  });
}

void Coordinator::Transition(RoundState to, const std::string& detail) {
  LogIfError(store_.Transition(round_, state_, to, clock_.UnixMs(), detail), "store");
  state_ = to;
}

void Coordinator::OnUpdateBegin(const std::shared_ptr<ClientSession>& session, const v1::UpdateBegin& begin) {
  const std::string& name = session->name();
  if (!round_running_ || state_ != RoundState::kCollecting || begin.round() != round_) {
    return Reject(session, v1::Error::ROUND_NOT_OPEN,
                  round_running_ && state_ == RoundState::kCollecting
                      ? fmt::format("update for round {} but round {} is open", begin.round(), round_)
                      : fmt::format("update for round {} but no round is collecting updates", begin.round()));
  }
  auto it = participants_.find(name);
  if (it == participants_.end()) {
    return Reject(session, v1::Error::NOT_SELECTED, fmt::format("{} was not selected for round {}", name, round_));
  }
  Participant& p = it->second;
  // It trains only on a model whose checksum it verified: it holds this
  // round's version now.
  distribution_.Confirm(name);
  if (secagg_) {  // a site that does not speak the protocol: its update would be in the clear
    return Reject(session, v1::Error::BAD_MESSAGE,
                  fmt::format("round {} sums updates by secure aggregation: a plain update is refused", round_));
  }
  if (slots_.Staged(name) || slots_.Queued(name) || p.record.status != "selected") {
    return Reject(session, v1::Error::DUPLICATE_UPDATE,
                  fmt::format("second update from {} in round {}", name, round_));
  }
  auto layout = CheckUpdateBegin(begin, name, task_.update_kind(), config_.federation.limits(), manifest_, lora_);
  if (!layout.ok()) return Reject(session, v1::Error::BAD_MESSAGE, layout.status().message());
  p.begin = begin;
  p.layout = std::move(layout).value();
  auto staging = StagedLayout(begin, name, p.layout, config_.federation.strategy().name() == "scaffold");
  if (!staging.ok()) return Reject(session, v1::Error::BAD_MESSAGE, staging.status().message());
  Status staged = slots_.Begin(session, *staging);
  if (!staged.ok()) return Reject(session, v1::Error::SERVER_BUSY, staged.message());
}

void Coordinator::GrantSlots() {
  for (const auto& [session, why] : slots_.Grant()) Reject(session, v1::Error::SERVER_BUSY, why.message());
}

void Coordinator::OnUpdateChunk(const std::shared_ptr<ClientSession>& session, const v1::UpdateChunk& chunk) {
  auto it = participants_.find(session->name());
  if (!round_running_ || chunk.round() != round_ || it == participants_.end() || it->second.record.status != "selected") {
    return Reject(session, v1::Error::ROUND_NOT_OPEN,
                  fmt::format("update chunk for round {}, which is not open for this client", chunk.round()));
  }
  StagedUpdate* staged = slots_.Staged(session->name());
  if (!staged) return Reject(session, v1::Error::BAD_MESSAGE, "update chunk before update_begin");
  Status appended = staged->Append(chunk.offset(), chunk.dtype(), chunk.data());
  if (!appended.ok()) return Reject(session, v1::Error::BAD_CHUNK, appended.message());
}

void Coordinator::OnUpdateCommit(const std::shared_ptr<ClientSession>& session, const v1::UpdateCommit& commit) {
  const std::string& name = session->name();
  auto it = participants_.find(name);
  if (!round_running_ || commit.round() != round_ || it == participants_.end() || !slots_.Staged(name) ||
      it->second.record.status != "selected") {
    return Reject(session, v1::Error::ROUND_NOT_OPEN,
                  fmt::format("update commit for round {}, which has no open upload from this client", commit.round()));
  }
  Participant& p = it->second;
  if (commit.digest().size() != crypto::kTransferDigestHexDigits) {
    return Reject(session, v1::Error::BAD_MESSAGE,
                  fmt::format("update digest has {} characters; an XXH3-128 hex digest has {}", commit.digest().size(),
                              crypto::kTransferDigestHexDigits));
  }
  Status committed = slots_.Staged(name)->Commit(commit.digest());
  if (!committed.ok()) return Reject(session, v1::Error::CHECKSUM_MISMATCH, committed.message());

  std::shared_ptr<StagedUpdate> staged = slots_.TakeForFold(name);
  p.record.status = "folding";
  p.record.examples = p.begin.num_examples();
  p.record.train_loss = p.begin.train_loss();
  p.record.bytes_up = staged->received_bytes();
  p.record.seconds = SecondsSince(p.started);
  spdlog::debug("round {}: update from {} committed after {:.3f} s (trained {:.3f} s)", round_, name,
                p.record.seconds, p.begin.train_seconds());
  ++folds_in_flight_;
  const aggregation::LocalWork work{.steps = p.begin.local_steps(), .normalizer = p.begin.normalizer()};
  asio::post(worker_, [this, staged, examples = p.begin.num_examples(), name, layout = p.layout, work] {
    const auto start = std::chrono::steady_clock::now();
    // The delta, then SCAFFOLD's Δc_i where the upload has one (StagedLayout).
    const std::span<const float> values = staged->values();
    Result<std::string> folded = aggregator_->Fold(name, layout, staged, values.first(layout.total_elements), examples,
                                                   work, values.subspan(layout.total_elements));
    if (metrics_ && folded.ok()) {
      metrics_->Folded(staged->values().size() * sizeof(float),
                       std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    asio::post(io_, [this, name, folded = std::move(folded)] { OnFolded(name, folded); });
  });
}

void Coordinator::OnFolded(const std::string& name, const Result<std::string>& folded) {
  --folds_in_flight_;
  slots_.FoldDone();
  Participant& p = participants_.at(name);
  auto session = p.session.lock();
  const Status status = folded.status();
  if (status.ok()) {
    p.record.status = "committed";
    p.record.detail = *folded;  // what the federation's bound did to it, if anything
    if (!folded->empty()) spdlog::warn("round {}: update from {}: {}", round_, name, *folded);
    ++record_.updates_received;
    record_.bytes_up += p.record.bytes_up;
    loss_sum_ += p.record.train_loss * double(p.record.examples);
    examples_sum_ += double(p.record.examples);
  } else {
    p.record.status = "rejected";
    p.record.detail = status.message();
  }
  LogIfError(store_.UpsertParticipation(p.record), "store");
  if (session && !session->closed()) session->Send(UpdateAckMessage(round_, status));
  GrantSlots();
  MaybeFinishRound();
}

void Coordinator::Reject(const std::shared_ptr<ClientSession>& session, v1::Error::Code code,
                         const std::string& message) {
  spdlog::warn("rejected {} ({}): {}", session->name(), session->address(), message);
  if (metrics_) metrics_->UploadRejected(code);
  LogIfError(store_.RecordEvent({clock_.UnixMs(), "update_rejected", session->name() + "@" + session->address(),
                                 fmt::format("{}: {}", v1::Error::Code_Name(code), message)}),
             "store");
  auto it = participants_.find(session->name());
  if (round_running_ && it != participants_.end() && it->second.session.lock() == session &&
      it->second.record.status == "selected") {
    Participant& p = it->second;
    ReleaseSlot(p.record.client);
    p.record.status = "rejected";
    p.record.detail = message;
    LogIfError(store_.UpsertParticipation(p.record), "store");
    if (secagg_) SecAggGone(p.record.client);
  }
  session->SendErrorAndClose(code, message);
  GrantSlots();
  MaybeFinishRound();
}

void Coordinator::OnRefusal(const std::shared_ptr<ClientSession>& session, const v1::SiteRefusal& refusal) {
  // One line, bounded: the reason is the peer's text.
  std::string reason = refusal.reason().substr(0, 1024);
  std::replace(reason.begin(), reason.end(), '\n', ' ');
  const bool stays = refusal.stays();
  spdlog::warn("client {} {} round {}: {}", session->name(), stays ? "failed" : "refused", refusal.round(), reason);
  LogIfError(store_.RecordEvent({clock_.UnixMs(), stays ? "site_failed" : "site_refused",
                                 session->name() + "@" + session->address(),
                                 fmt::format("round {}: {}", refusal.round(), reason)}),
             "store");
  // A refusing site leaves; closing from this end lets it go once it has read what was queued for it.
  if (!stays) session->CloseAfterWrites();
  if (!stays && eval_ && refusal.round() == eval_->round) EvaluationGone(session->name(), "refused: " + reason);
  auto it = participants_.find(session->name());
  if (!round_running_ || refusal.round() != round_ || it == participants_.end() ||
      it->second.session.lock() != session || it->second.record.status != "selected") {
    return;
  }
  Participant& p = it->second;
  ReleaseSlot(p.record.client);
  p.record.status = stays ? "failed" : "refused";
  p.record.detail = reason;
  p.record.seconds = SecondsSince(p.started);
  LogIfError(store_.UpsertParticipation(p.record), "store");
  if (secagg_) SecAggGone(p.record.client);
  GrantSlots();
  MaybeFinishRound();
}

void Coordinator::OnClosed(ClientSession& session) {
  auto it = connected_.find(session.name());
  if (it != connected_.end() && it->second.get() == &session) connected_.erase(it);
  if (metrics_) metrics_->SetConnectedSites(connected_.size());
  if (eval_) {
    auto e = eval_->sites.find(session.name());
    if (e != eval_->sites.end() && e->second.session.lock().get() == &session) {
      EvaluationGone(session.name(), "connection lost");
    }
  }
  auto p_it = participants_.find(session.name());
  if (round_running_ && p_it != participants_.end() && p_it->second.session.lock().get() == &session &&
      p_it->second.record.status == "selected") {
    Participant& p = p_it->second;
    // Where it was lost: the round log tells a partial upload from none.
    const StagedUpdate* staged = slots_.Staged(p.record.client);
    p.record.detail =
        secagg_ ? fmt::format("connection lost in secagg stage {}", RoundSecAgg::kStages[std::min<int>(secagg_->stage, 4)])
        : staged ? fmt::format("{}: {} of {} bytes received, discarded", kLostMidUpload, staged->received_bytes(),
                               staged->size_bytes())
        : slots_.Queued(p.record.client) ? fmt::format("{}: waiting for a staging slot, discarded", kLostMidUpload)
                                         : "connection lost";
    ReleaseSlot(p.record.client);  // a partial upload is discarded here, unread (a secagg one withdrawn)
    p.record.status = "dropped";
    p.record.seconds = SecondsSince(p.started);
    LogIfError(store_.UpsertParticipation(p.record), "store");
    spdlog::info("client {} dropped out of round {}", session.name(), round_);
    if (secagg_) SecAggGone(session.name());
    GrantSlots();
    MaybeFinishRound();
  }
}

void Coordinator::OnDeadline() {
  deadline_passed_ = true;
  if (secagg_) return MaybeCloseSecAggStage(true);
  for (auto& [name, p] : participants_) {
    if (p.record.status != "selected") continue;
    slots_.Release(name);
    p.record.status = "late";
    p.record.detail = "no update before the deadline";
    p.record.seconds = SecondsSince(p.started);
    LogIfError(store_.UpsertParticipation(p.record), "store");
    if (auto session = p.session.lock(); session && !session->closed()) session->Resume();
  }
  spdlog::info("round {} deadline: {} updates received", round_, record_.updates_received);
  MaybeFinishRound();
}

void Coordinator::MaybeFinishRound() {
  // A secure aggregation ends when its last stage closes (FinishSecAgg).
  if (!round_running_ || state_ != RoundState::kCollecting || folds_in_flight_ > 0 || secagg_) return;
  bool all_answered = true;
  for (const auto& [name, p] : participants_) all_answered &= p.resolved();
  if (!all_answered && !deadline_passed_) return;
  if (record_.updates_received >= std::min<uint32_t>(config_.min_updates, record_.clients_selected)) {
    Aggregate();
  } else {
    FailRound(fmt::format("{} of {} updates received, {} needed", record_.updates_received,
                          record_.clients_selected, config_.min_updates));
  }
}

void Coordinator::Aggregate() {
  if (record_.updates_received == 0) return FailRound("no updates received");
  deadline_->Cancel();
  Transition(RoundState::kAggregating);
  collect_seconds_ = SecondsSince(round_started_);
  asio::post(worker_, [this, round = round_, previous = distribution_.current()] {
    Aggregator::Finished result = aggregator_->Finish(round, previous);
    asio::post(io_, [this, result = std::move(result)]() mutable { OnAggregated(std::move(result)); });
  });
}

void Coordinator::OnAggregated(Aggregator::Finished result) {
  if (!result.status.ok()) return FailRound(result.status.ToString());
  const uint64_t per_update = record_.updates_received > 0 ? record_.bytes_up / record_.updates_received : 0;
  // The round log says what an update cost, for either kind; for lora also
  // what the merge changed per client (exact: adapters plus residuals).
  record_.detail = lora_ ? fmt::format("update kind lora ({}): {} bytes per update; the merge changed {} bytes per "
                                       "client",
                                       aggregator_->name(), per_update, result.changed_bytes)
                         : fmt::format("update kind full ({}): {} bytes per update", aggregator_->name(), per_update);
  if (secagg_) record_.secagg = secagg_->record;
  record_.ended_ms = clock_.UnixMs();
  record_.model_version = distribution_.current().version + 1;
  record_.global_checksum = result.model.checksum;
  record_.train_loss = examples_sum_ > 0 ? loss_sum_ / examples_sum_ : 0;
  const auto& eval = result.eval;
  if (eval) {
    record_.test_accuracy = eval->accuracy;
    record_.test_loss = eval->loss;
  }
  record_.state = RoundState::kCommitted;
  std::vector<double> distributed_rdp;  // distributed DP: this round's RDP, per order
  if (Status privacy = RecordPrivacy(result, &distributed_rdp); !privacy.ok()) return FailRound(privacy.ToString());
  Status committed = store_.CommitRound(record_, result.checkpoint, clock_.UnixMs());
  if (!committed.ok()) return FailRound(fmt::format("cannot commit to the round log: {}", committed.ToString()));
  // Only a committed round released anything, so only it is spent.
  if (record_.privacy) {
    LogIfError(distributed_rdp.empty()
                   ? accountant_->AddRounds(round_sampling_rate_, record_.privacy->noise_multiplier)
                   : accountant_->AddRoundRdp(distributed_rdp),
               "privacy accountant");
  }
  // The log holds the commit; a marker left behind is brought forward from
  // the log at the next start, so a failure here costs only that check.
  LogIfError(aggregator_->MarkCommitted(round_), "checkpoint directory");
  state_ = RoundState::kCommitted;
  result.model.version = record_.model_version;
  distribution_.Publish(std::move(result.model), std::move(result.low_rank));
  distribution_.SetControl(std::move(result.control));
  const double seconds = SecondsSince(round_started_);
  if (metrics_) {
    metrics_->RoundEnded(RoundState::kCommitted, seconds);
    if (record_.privacy) metrics_->SetEpsilon(record_.privacy->epsilon, record_.privacy->delta);
  }
  if (events_) LogIfError(events_->WriteScalars(int64_t(round_), RoundScalars(record_, seconds)), "tensorboard");
  spdlog::info("round {} committed: {} updates, train loss {:.4f}{}{}, {:.3f} s ({:.3f} s collecting)", round_,
               record_.updates_received, record_.train_loss,
               eval ? fmt::format(", test accuracy {:.4f}", eval->accuracy) : std::string(),
               record_.privacy ? fmt::format(", ε {:.4g} at δ {:g}", record_.privacy->epsilon, record_.privacy->delta)
                               : std::string(),
               seconds, collect_seconds_);

  // After the last round the federation ends once its evaluation has.
  SendToAll(connected_, RoundCommittedMessage(record_, seconds, per_update, result.changed_bytes,
                                              round_ == config_.rounds && !EvaluationDue(round_)));

  round_running_ = false;
  secagg_.reset();
  ++round_;
  failed_tries_ = 0;
  if (EvaluationDue(round_ - 1) && StartEvaluation(round_ - 1)) return;
  AfterRound();
}

void Coordinator::TellLateSites() {
  late_sites_.Start(SitesInRoundLog(store_), clock_, LateSites::Limit(config_.idle_timeout_s), on_complete_);
}

void Coordinator::AfterRound() {
  if (complete()) {
    // The last round's RoundClosed left the federation open for its evaluation.
    if (round_ > config_.rounds && EvaluationDue(config_.rounds)) {
      SendToAll(connected_, FederationCompleteMessage(config_.rounds, distribution_.current()));
    }
    spdlog::info("federation complete after {} rounds", config_.rounds);
    LogIfError(store_.SetMeta("complete", std::to_string(round_ - 1)), "store");
    if (on_complete_) on_complete_();
    return;
  }
  MaybeStartRound();
}

void Coordinator::FailRound(const std::string& reason) {
  deadline_->Cancel();
  if (secagg_) LogIfError(store_.RecordSecAgg(round_, secagg_->record), "store");
  secagg_.reset();
  LogIfError(store_.FailRound(round_, reason, clock_.UnixMs()), "store");
  LogIfError(store_.RecordEvent({.at_ms = clock_.UnixMs(),
                                 .kind = "round_failed",
                                 .detail = fmt::format("{}{}: {}", FailedTryPrefix(round_), failed_tries_ + 1, reason)}),
             "store");
  // Logged once the round log holds the failure, so whoever reads the line
  // (an operator, a test) finds it there.
  spdlog::warn("round {} failed: {}", round_, reason);
  state_ = RoundState::kFailed;
  if (metrics_) metrics_->RoundEnded(RoundState::kFailed, SecondsSince(round_started_));
  for (auto& [name, p] : participants_) slots_.Release(name);
  SendToAll(connected_, RoundFailedMessage(record_, distribution_.current(), reason));
  round_running_ = false;
  ++failed_tries_;
  // The same round number is tried again, after a pause so a flapping
  // federation does not spin.
  retry_->Arm(std::chrono::seconds(1), [this] { MaybeStartRound(); });
}

void Coordinator::CloseAll() {
  closing_ = true;
  deadline_->Cancel();
  eval_deadline_->Cancel();
  retry_->Cancel();
  CloseAllAfterWrites(connected_);
}

std::vector<std::shared_ptr<ClientSession>> Coordinator::Connected() const { return SessionsOf(connected_); }

}  // namespace estuary::server
