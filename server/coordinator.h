// Coordinator: runs the federation's rounds, one at a time.
//
// A round is an explicit state machine, every transition recorded in the
// Store:  open -> collecting -> aggregating -> committed | failed.
// It opens when min_clients are connected, samples clients_per_round of them
// with the seed, sends each a RoundStart and the global model, and collects
// updates until every selected client has answered or dropped, or until the
// deadline (then it aggregates if min_updates arrived, else the round fails
// and is retried). Uploads are staged (at most staging_slots at once; a
// client beyond that is paused, not refused) and folded into the Strategy
// only when committed. Folding, evaluation and checkpointing (Aggregator) run
// on the worker executor; everything else on the I/O executor, one thread, so
// no locks are needed. A restart resumes after the last committed round, from its
// checkpoint. A Hello reaches it once Connections has checked the session's
// protocol and certificate.
//
// Time comes from a Clock and the two executors are given to it, so tests
// drive all of it from one thread. Everything posted to the worker must have
// run (a joined thread pool) before the Coordinator is destroyed.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "aggregation/lora_strategy.h"
#include "base/asio.h"
#include "proto/model_patch.h"
#include "server/aggregator.h"
#include "server/client_session.h"
#include "server/clock.h"
#include "server/config.h"
#include "server/staging.h"
#include "server/store.h"

namespace estuary::server {

class Coordinator {
 public:
  Coordinator(const ServerConfig& config, Store& store, Clock& clock, boost::asio::any_io_executor io,
              boost::asio::any_io_executor worker);
  ~Coordinator();

  // Builds the federation (BuildFederation), then loads the last committed
  // round's checkpoint, or starts from the initial model.
  Status Recover();

  // A hello from a session that passed the connection's checks; it replaces
  // an earlier connection under the same name.
  void OnHello(const std::shared_ptr<ClientSession>& session, const v1::Hello& hello);
  void OnMessage(const std::shared_ptr<ClientSession>& session, v1::Envelope envelope);
  void OnClosed(ClientSession& session);

  // Called once the federation is complete (the last round committed).
  void set_on_complete(std::function<void()> fn) { on_complete_ = std::move(fn); }
  // Lets every connected client finish reading what is queued, then closes it.
  void CloseAll();
  // The sessions of the connected clients, in name order.
  std::vector<std::shared_ptr<ClientSession>> Connected() const;
  bool complete() const { return round_ > config_.rounds; }
  // The round running, or the next to run.
  uint64_t round() const { return round_; }

 private:
  struct Participant {
    std::weak_ptr<ClientSession> session;
    Participation record;
    std::unique_ptr<StagedUpdate> staged;
    bool waiting_for_slot = false;
    v1::UpdateBegin begin;
    Manifest layout;  // the upload's: the global model's, or a LoRA site's adapter factors
    bool patch = false;  // the download is patch_ only
    std::chrono::steady_clock::time_point started;
    bool resolved() const { return record.status != "selected" && record.status != "folding"; }
  };

  void MaybeStartRound();
  void StartRound();
  void OnUpdateBegin(const std::shared_ptr<ClientSession>& session, const v1::UpdateBegin& begin);
  void OnUpdateChunk(const std::shared_ptr<ClientSession>& session, const v1::UpdateChunk& chunk);
  void OnUpdateCommit(const std::shared_ptr<ClientSession>& session, const v1::UpdateCommit& commit);
  void Reject(const std::shared_ptr<ClientSession>& session, v1::Error::Code code, const std::string& message);
  void GrantSlots();
  // Streams the model to the next waiting client while fewer than
  // kConcurrentDownloads streams are running: clients then receive it one
  // after another and start training early, instead of all at the end.
  void StreamModels();
  // Fills patch_ for this round (previous_global_ against global_).
  void FindChangedTensors();
  void ReleaseSlot(Participant& p);
  void OnFolded(const std::string& name, Status status);
  void OnDeadline();
  void MaybeFinishRound();
  void Aggregate();
  void OnAggregated(Aggregator::Finished result);
  void FailRound(const std::string& reason);
  void Transition(RoundState to, const std::string& detail = {});
  void Broadcast(const v1::Envelope& envelope);
  void LogIfError(const Status& status, const char* what);
  double SecondsSince(std::chrono::steady_clock::time_point start) const;

  const ServerConfig& config_;
  Store& store_;
  Clock& clock_;
  boost::asio::any_io_executor io_;
  boost::asio::any_io_executor worker_;  // folds, evaluation, checkpoints: never the I/O thread
  std::unique_ptr<Timer> deadline_;
  std::unique_ptr<Timer> retry_;

  std::unique_ptr<Aggregator> aggregator_;  // touched only on worker_, but for its name
  std::optional<aggregation::LoraStrategyOptions> lora_;  // set in a federation of update kind lora
  Manifest manifest_;
  std::shared_ptr<const std::vector<float>> global_;
  std::string global_checksum_;
  // The global model before the last commit: a site that holds it and keeps
  // models gets only the tensors that changed since (a lora federation's
  // adapter, and the base weights exact folded residuals into).
  std::shared_ptr<const std::vector<float>> previous_global_;
  std::string previous_checksum_;
  // The tensors the last commit changed by a low-rank product (previous_global_
  // to global_), which a patch sends as factors: their offsets, and every
  // change's u then v, the stream's tail after the patch ranges.
  std::vector<aggregation::LowRankChange> low_rank_;
  std::shared_ptr<const std::vector<float>> low_rank_factors_;
  std::set<std::string> keeps_model_;  // sites whose Hello said they keep the model
  // This round's patch from the previous version: the tensors of the global
  // model that differ from it, as merged element ranges (none: no previous
  // version, or everything changed), and low_rank_'s as their factors.
  proto::ModelPatch patch_;
  uint64_t model_version_ = 0;

  std::map<std::string, std::shared_ptr<ClientSession>> connected_;  // by certificate name
  uint64_t round_ = 1;
  bool round_running_ = false;
  RoundState state_ = RoundState::kOpen;
  RoundRecord record_;
  std::chrono::steady_clock::time_point round_started_;
  std::map<std::string, Participant> participants_;
  uint32_t staging_in_use_ = 0;
  std::deque<std::string> slot_queue_;
  uint32_t folds_in_flight_ = 0;
  bool deadline_passed_ = false;
  std::deque<std::weak_ptr<ClientSession>> download_queue_;
  uint32_t downloads_in_flight_ = 0;
  uint64_t attempt_ = 0;  // counts StartRound calls: a retried round reuses its number
  double collect_seconds_ = 0;
  std::map<std::string, std::pair<uint64_t, std::string>> held_;  // name -> model version, checksum
  double loss_sum_ = 0;
  double examples_sum_ = 0;
  std::function<void()> on_complete_;
};

}  // namespace estuary::server
