// Coordinator: runs the federation's rounds, one at a time.
//
// A round is an explicit state machine, every transition recorded in the
// Store:  open -> collecting -> aggregating -> committed | failed.
// It opens when min_clients are connected, samples clients_per_round of them
// with the seed, sends each a RoundStart and what it must download
// (ModelDistribution), and collects updates until every selected client has
// answered or dropped, or until the deadline (then it aggregates if
// min_updates arrived, else the round fails and is retried after a pause).
// Uploads are checked (CheckUpdateBegin), staged (StagingSlots: a client
// beyond staging_slots is paused, not refused) and folded into the strategy
// only when committed. Folding, aggregation, evaluation and checkpointing
// (Aggregator) run on the worker executor; everything else on the I/O
// executor, a strand, so no locks are needed. A restart resumes after the
// last committed round, from its checkpoint. In a DP federation each
// committed round's sampling rate (selected / connected), noise and ε go into
// the round log, and a round that would take ε beyond dp.max_epsilon is not
// opened: the federation completes instead. A Hello reaches it once
// Connections has checked the session's protocol and certificate. Under
// secure aggregation (config.secagg) collecting runs SecAgg+'s five stages
// over the selected sessions instead of uploads, and the unmasked mean is
// folded as one update (coordinator_secagg.cc, server/secagg_state.h); the
// protocol's threshold t, not min_updates, decides whether the round goes on.
// With config.evaluate_every, a committed round that is due is followed by
// its evaluation round (coordinator_eval.cc): sites whose Hello said they
// evaluate download the new model and score it on their own held-out data;
// their answers, folded by AggregateEvaluations, go into the round log, and
// only then does the next round (or, after the last, the federation's end)
// come. A site that fails, does not evaluate, or does not answer before the
// deadline is counted apart and holds nothing up beyond that deadline.
// Under SCAFFOLD every training round's sites download the server's control
// variate c after the model (ModelDistribution::SetControl) and upload their
// Δc_i after their delta, staged with it as one upload (StagedLayout); the
// fold takes both (Aggregator::Fold), and the committed round's c, which
// the checkpoint holds too, goes out with the next round.
//
// Time comes from a Clock and the two executors are given to it, so tests
// drive all of it from one thread. Everything posted to the worker must have
// run (a joined thread pool) before the Coordinator is destroyed.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "aggregation/lora_strategy.h"
#include "base/asio.h"
#include "server/aggregator.h"
#include "server/client_session.h"
#include "server/clock.h"
#include "server/config.h"
#include "server/distribution.h"
#include "server/late_sites.h"
#include "proto/event_file.h"
#include "server/evaluation.h"
#include "server/metrics.h"
#include "server/round_driver.h"
#include "server/secagg_state.h"
#include "server/staging_slots.h"
#include "privacy/accountant.h"
#include "server/store.h"

namespace estuary::server {

class Coordinator final : public RoundDriver {
 public:
  Coordinator(const ServerConfig& config, Store& store, Clock& clock, boost::asio::any_io_executor io,
              boost::asio::any_io_executor worker);
  ~Coordinator() override;

  // Builds the federation (RecoverFederation), then loads the last committed
  // round's checkpoint, or starts from the initial model.
  Status Recover() override;

  // A hello from a session that passed the connection's checks; it replaces
  // an earlier connection under the same name.
  void OnHello(const std::shared_ptr<ClientSession>& session, const v1::Hello& hello) override;
  void OnMessage(const std::shared_ptr<ClientSession>& session, v1::Envelope envelope) override;
  void OnClosed(ClientSession& session) override;

  // Called once the federation is complete (the last round committed).
  void set_on_complete(std::function<void()> fn) override { on_complete_ = std::move(fn); }
  void TellLateSites() override;
  // Where rounds, sites, rejections and folds are counted (server/metrics.h);
  // null (the default): nowhere. Must outlive the Coordinator.
  void set_metrics(Metrics* metrics) override { metrics_ = metrics; }
  // Each committed round's scalars go to `events` too (serve --tensorboard).
  void set_event_file(proto::EventFile* events) override { events_ = events; }
  // Lets every connected client finish reading what is queued, then closes
  // it; a Hello from then on is closed the same way.
  void CloseAll() override;
  // The sessions of the connected clients, in name order.
  std::vector<std::shared_ptr<ClientSession>> Connected() const override;
  // The last round committed, or the privacy budget stopped the federation.
  bool complete() const override { return (round_ > config_.rounds && !eval_) || budget_spent_; }
  // The round running, or the next to run.
  uint64_t round() const { return round_; }

 private:
  Status CountFailedTries();  // failed_tries_ of round_, from the round log
  struct Participant {
    std::weak_ptr<ClientSession> session;
    Participation record;
    v1::UpdateBegin begin;
    Manifest layout;  // the upload's: the global model's, or a LoRA site's adapter factors
    std::chrono::steady_clock::time_point started;
    bool resolved() const { return record.status != "selected" && record.status != "folding"; }
  };

  void MaybeStartRound();
  void StartRound();
  void OnUpdateBegin(const std::shared_ptr<ClientSession>& session, const v1::UpdateBegin& begin);
  void OnUpdateChunk(const std::shared_ptr<ClientSession>& session, const v1::UpdateChunk& chunk);
  void OnUpdateCommit(const std::shared_ptr<ClientSession>& session, const v1::UpdateCommit& commit);
  // The site will not train the round (its base is not the federation's):
  // its participation is "refused" with its reason, and an event records it.
  void OnRefusal(const std::shared_ptr<ClientSession>& session, const v1::SiteRefusal& refusal);
  void Reject(const std::shared_ptr<ClientSession>& session, v1::Error::Code code, const std::string& message);
  // Stages waiting uploads as slots free; an upload that cannot be staged is rejected.
  void GrantSlots();
  void OnFolded(const std::string& name, const Result<std::string>& folded);
  void OnDeadline();
  void MaybeFinishRound();
  void Aggregate();
  void OnAggregated(Aggregator::Finished result);
  void FailRound(const std::string& reason);
  // DP: false, having completed the federation, when the round would take ε
  // beyond dp.max_epsilon; sets round_sampling_rate_ otherwise.
  bool WithinPrivacyBudget(size_t selected, size_t population);
  // The round's sites from the connected `names` (coordinator_privacy.cc):
  // clients_per_round of them, or under Poisson sampling each with
  // probability sample_rate. False when no round opens now (a draw too small
  // for a round is drawn again after the pause).
  bool DrawSites(const std::vector<std::string>& names, std::vector<std::string>* selected);
  // A committed round's record_.privacy: central DP's ε from `result.dp`, or
  // distributed DP's from the shares its sum held, whose RDP per order goes
  // to `distributed_rdp` for the accountant once the round is committed.
  Status RecordPrivacy(const Aggregator::Finished& result, std::vector<double>* distributed_rdp);
  void Transition(RoundState to, const std::string& detail = {});
  // After a round committed (and its evaluation, if any): the next round, or
  // the federation's end.
  void AfterRound();

  // Federated evaluation (coordinator_eval.cc; config_.evaluate_every).
  bool EvaluationDue(uint64_t round) const;
  // Asks the sampled evaluating sites to score the model `round` committed;
  // false when no connected site evaluates (nothing is recorded then).
  bool StartEvaluation(uint64_t round);
  void OnEvalReport(const std::shared_ptr<ClientSession>& session, const v1::EvalReport& report);
  // A selected site that will not answer: dropped, refused, or the deadline.
  void EvaluationGone(const std::string& name, const std::string& why);
  void MaybeFinishEvaluation(bool deadline);

  // SecAgg+ (coordinator_secagg.cc; config_.secagg.on): the round's protocol
  // over the selected sites' sessions, each site's setup in its RoundStart.
  Status StartSecAgg(const std::vector<std::string>& selected);
  void OnSecAgg(const std::shared_ptr<ClientSession>& session, const v1::Envelope& envelope);
  // The site's session closed, or its message was refused: silent from now on.
  void SecAggGone(const std::string& name);
  // Closes the stage when nobody is left waiting, or (`deadline`) at its deadline.
  void MaybeCloseSecAggStage(bool deadline);
  void CloseSecAggStage();
  // Begins `stage`: sends each live site its message; bytes count toward `stage` − 1.
  void OpenSecAggStage(SecAggState::Stage stage, std::map<uint32_t, v1::Envelope> messages);
  void FinishSecAgg();
  // Frees `name`'s staging slot (the caller grants it on); in a secagg
  // round's masked input stage, a site whose input is partly in the sum is
  // withdrawn from it first (a failed withdrawal fails the round).
  void ReleaseSlot(const std::string& name);
  void ReleaseSecAggSlot(uint32_t site);
  void ArmSecAggDeadline();
  void LogIfError(const Status& status, const char* what);
  double SecondsSince(std::chrono::steady_clock::time_point start) const;

  const ServerConfig& config_;
  Store& store_;
  Clock& clock_;
  boost::asio::any_io_executor io_;
  boost::asio::any_io_executor worker_;  // folds, evaluation, checkpoints: never the I/O thread
  std::unique_ptr<Timer> deadline_;
  std::unique_ptr<Timer> retry_;
  std::unique_ptr<Timer> eval_deadline_;  // the evaluation round's

  v1::TaskConfig task_;  // what every selected client trains (the federation's, as built)
  std::unique_ptr<Aggregator> aggregator_;  // touched only on worker_, but for its name
  std::optional<aggregation::LoraStrategyOptions> lora_;  // set in a federation of update kind lora
  Manifest manifest_;
  ModelDistribution distribution_;
  StagingSlots slots_;

  SessionsByName connected_;  // by certificate name
  Metrics* metrics_ = nullptr;
  proto::EventFile* events_ = nullptr;
  uint64_t round_ = 1;
  // Tries of round_ that failed (counted from the round log after a restart):
  // each retry draws its sites with the seed mixed with this count, so a
  // failed round is not retried with the same sites.
  uint32_t failed_tries_ = 0;
  bool closing_ = false;  // CloseAll has run
  bool round_running_ = false;
  RoundState state_ = RoundState::kOpen;
  RoundRecord record_;
  std::chrono::steady_clock::time_point round_started_;
  std::map<std::string, Participant> participants_;
  uint32_t folds_in_flight_ = 0;
  bool deadline_passed_ = false;
  double collect_seconds_ = 0;
  double loss_sum_ = 0;
  double examples_sum_ = 0;
  std::function<void()> on_complete_;
  LateSites late_sites_;  // restarted complete: who has yet to be told
  std::string federation_id_;  // the checkpoint directory's and the round log's
  // DP: ε over the committed rounds (replayed from the round log at Recover).
  std::optional<privacy::Accountant> accountant_;
  double round_sampling_rate_ = 0;
  bool budget_spent_ = false;
  std::unique_ptr<SecAggState> secagg_;              // the round's, under config_.secagg.on
  std::map<std::string, uint64_t> hello_examples_;  // by certificate name: what each site's Hello claimed
  std::set<std::string> evaluators_;                // by certificate name: sites whose Hello said evaluates

  struct EvalSite {
    std::weak_ptr<ClientSession> session;
    bool answered = false;
    SiteEvaluation result;
  };
  struct EvalPhase {
    uint64_t round = 0;
    std::chrono::steady_clock::time_point started;
    std::map<std::string, EvalSite> sites;
  };
  std::optional<EvalPhase> eval_;  // the evaluation round running, if any
};

}  // namespace estuary::server
