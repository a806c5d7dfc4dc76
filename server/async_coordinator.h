// AsyncCoordinator: a federation of asynchronous rounds (FedBuff, Nguyen et
// al. 2022; serve --mode async), the RoundDriver beside the synchronous
// Coordinator.
//
// There is no round barrier. Once min_clients are connected, up to
// `concurrency` sites (config.async; 0: all) are training at once, drawn with
// the seed (aggregation::SampleClients) from the connected sites with no work
// out. Each is sent a RoundStart with asynchronous set: the newest committed
// model (version v, downloaded as in a round: ModelDistribution) and round
// v + 1, the version being built. Its upload says the version it trained
// from (UpdateBegin.trained_from_version, which must be the one it was
// given), is checked, staged and committed as in a round, and then folded on
// the worker into aggregation::FedBuff with the weight s(staleness),
// staleness = the server's version at the fold − trained_from. The fold of
// the K-th accepted update steps the model there and then (Aggregator::
// FoldAsync), so the next fold's staleness is against the new version; the
// I/O thread commits that version to the round log (round = version, state
// committed, its checkpoint) and begins the next version's row. Every update
// is recorded in the round log as an Arrival of the version being built:
// folded with its staleness and weight, refused as stale (beyond
// max_staleness, one line in the log, weight 0) or rejected by the
// federation's limits. However it was answered (UpdateAck), the site is idle
// again and drawn again with the others: with concurrency at least the sites
// connected, every site is given the newest model as soon as it is answered.
// A site that has not committed its upload within round_deadline of its
// RoundStart is recorded late (an event) and is idle again. After `rounds`
// versions the federation completes as a synchronous one does (meta
// complete, RoundClosed with federation_complete to every site); the server
// is told (set_on_complete) once the sites have left, or after idle_timeout.
//
// Restart: the buffer is not checkpointed. A restarted server resumes at the
// last committed version (its checkpoint); the version it was building is
// begun again, its arrivals' rows discarded with it, as an unfinished round's
// are. Work given out before the restart is forgotten with its connections:
// an upload is accepted only for work this server sent, so the sites, once
// reconnected, are given the restored version and judged against it.
//
// What asynchronous rounds cannot run with is refused at configuration
// (ServerConfig::CheckAsync). Threading as the Coordinator's: the I/O
// executor is a strand, the worker folds, steps and checkpoints.
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

#include "base/asio.h"
#include "server/aggregator.h"
#include "server/client_session.h"
#include "server/clock.h"
#include "server/config.h"
#include "server/distribution.h"
#include "server/late_sites.h"
#include "server/round_driver.h"
#include "server/staging_slots.h"
#include "server/store.h"

namespace estuary::server {

class AsyncCoordinator final : public RoundDriver {
 public:
  AsyncCoordinator(const ServerConfig& config, Store& store, Clock& clock, boost::asio::any_io_executor io,
                   boost::asio::any_io_executor worker);
  ~AsyncCoordinator() override;

  Status Recover() override;
  void OnHello(const std::shared_ptr<ClientSession>& session, const v1::Hello& hello) override;
  void OnMessage(const std::shared_ptr<ClientSession>& session, v1::Envelope envelope) override;
  void OnClosed(ClientSession& session) override;
  void set_on_complete(std::function<void()> fn) override { on_complete_ = std::move(fn); }
  void TellLateSites() override;
  void set_metrics(Metrics* metrics) override { metrics_ = metrics; }
  void set_event_file(proto::EventFile* events) override { events_ = events; }
  void CloseAll() override;
  std::vector<std::shared_ptr<ClientSession>> Connected() const override;
  // `rounds` versions committed.
  bool complete() const override { return version_ >= config_.rounds; }

  // The last version committed (0: the initial model).
  uint64_t version() const { return version_; }
  // Sites with work out: training, uploading or being folded.
  size_t training() const { return work_.size(); }

 private:
  // A site's work: from its RoundStart until its update is answered.
  struct Work {
    std::weak_ptr<ClientSession> session;
    uint64_t id = 0;     // which assignment, for its deadline
    uint64_t round = 0;  // the version being built when it was sent
    uint64_t from = 0;   // the model version it was given
    enum class State { kTraining, kUploading, kFolding } state = State::kTraining;
    v1::UpdateBegin begin;
    Manifest layout;
    uint64_t bytes_up = 0;
    std::chrono::steady_clock::time_point started;
    std::unique_ptr<Timer> deadline;
  };

  // Draws sites for the free places among the concurrency's, and sends each work.
  void MaybeAssign();
  void Assign(const std::string& name);
  // The version being built gets its row: open, then collecting.
  bool BeginVersion();
  void OnUpdateBegin(const std::shared_ptr<ClientSession>& session, const v1::UpdateBegin& begin);
  void OnUpdateChunk(const std::shared_ptr<ClientSession>& session, const v1::UpdateChunk& chunk);
  void OnUpdateCommit(const std::shared_ptr<ClientSession>& session, const v1::UpdateCommit& commit);
  void OnRefusal(const std::shared_ptr<ClientSession>& session, const v1::SiteRefusal& refusal);
  void OnFolded(const std::string& name, Aggregator::AsyncFolded folded);
  void Commit(Aggregator::Finished step);
  // The site's work ends without an update (dropped, late, refused, failed): it is idle.
  void EndWork(const std::string& name, const std::string& why);
  // Work of `session` in state kTraining or kUploading, or null.
  Work* OpenWork(const std::shared_ptr<ClientSession>& session);
  void Reject(const std::shared_ptr<ClientSession>& session, v1::Error::Code code, const std::string& message);
  void GrantSlots();
  void Halt(const std::string& reason);
  // After the last version: on_complete_ once every site has left, or at finish_timer_.
  void MaybeFinish();
  void Finish();
  void LogIfError(const Status& status, const char* what);

  const ServerConfig& config_;
  Store& store_;
  Clock& clock_;
  boost::asio::any_io_executor io_;
  boost::asio::any_io_executor worker_;
  v1::TaskConfig task_;
  std::optional<aggregation::LoraStrategyOptions> lora_;  // always empty: refused by CheckAsync
  std::unique_ptr<Aggregator> aggregator_;                // touched only on worker_ after Recover
  Manifest manifest_;
  ModelDistribution distribution_;
  StagingSlots slots_;
  SessionsByName connected_;
  std::map<std::string, Work> work_;  // by certificate name
  Metrics* metrics_ = nullptr;
  proto::EventFile* events_ = nullptr;
  std::function<void()> on_complete_;
  LateSites late_sites_;  // restarted complete: who has yet to be told

  uint64_t version_ = 0;      // the last committed
  bool started_ = false;      // min_clients were connected once: work goes out
  bool closing_ = false;
  bool halted_ = false;       // a version could not be committed: nothing more is folded
  bool finishing_ = false;    // the last version is committed; on_complete_ has not run
  std::unique_ptr<Timer> finish_timer_;
  uint64_t next_work_ = 0;    // Work::id
  uint64_t draws_ = 0;        // draws of sites so far: mixed into the seed
  uint64_t arrivals_ = 0;     // of the version being built
  RoundRecord record_;        // the version being built
  std::chrono::steady_clock::time_point version_started_;
  double loss_sum_ = 0;
  double examples_sum_ = 0;
  uint32_t stale_ = 0;        // refused as stale in the version being built
};

}  // namespace estuary::server
