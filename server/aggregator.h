// Aggregator: the federation's state that only the worker thread touches —
// the strategy, the update bound, the evaluator and the checkpointer — and a
// round's work on it: Begin, Fold each committed update (within the
// federation's limits: aggregation/update_bound.h), then Finish, which
// computes the new global model and writes its checkpoint while the
// evaluator scores it.
//
// The Coordinator posts every call but name() to the worker executor and
// takes the results back on the I/O thread, so nothing here is locked:
// nothing here is touched from two threads at once. Restore runs at
// recovery, before anything is posted.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "aggregation/dp_fedavg.h"
#include "aggregation/fedbuff.h"
#include "aggregation/strategy.h"
#include "aggregation/update_bound.h"
#include "base/manifest.h"
#include "base/status.h"
#include "models/federated_model.h"
#include "server/checkpointer.h"
#include "server/global_model.h"

namespace estuary::server {

class Aggregator {
 public:
  // What Finish hands back.
  struct Finished {
    Status status;
    GlobalModel model;  // the values and their checksum; the version is the commit's to set
    std::optional<models::EvalResult> eval;  // with an evaluator, unless scoring failed (logged)
    std::filesystem::path checkpoint;
    uint64_t changed_bytes = 0;                       // Strategy::changed_bytes
    std::vector<aggregation::LowRankChange> low_rank;  // Strategy::low_rank_changes
    std::optional<aggregation::DpRound> dp;            // what a DP-FedAvg round released
    // SCAFFOLD: the control variate c the next round's sites correct by
    // (checkpointed with the model); null under every other strategy.
    std::shared_ptr<const std::vector<float>> control;
  };

  // `evaluator` may be null. `manifest` is the global model's layout.
  Aggregator(std::unique_ptr<aggregation::Strategy> strategy, aggregation::UpdateBound bound,
             std::unique_ptr<models::Evaluator> evaluator, Checkpointer checkpointer, Manifest manifest);

  // The strategy's name: constant, so any thread may ask.
  std::string_view name() const { return strategy_->name(); }

  // The committed round's model written at `path`, checked against the
  // round log's `logged_checksum`; the strategy's and the bound's state come
  // back with it.
  Result<std::vector<float>> Restore(const std::filesystem::path& path, const std::string& logged_checksum);

  // `sampled`: the sites selected for the round (Strategy::PlanRound).
  // `expected` > 0 (Poisson sampling): DP-FedAvg's fixed denominator, q ·
  // population, instead of `sampled` (aggregation::DpFedAvg::PlanExpected).
  Status Begin(uint64_t round, std::span<const float> global, uint64_t sampled, double expected = 0);
  // Folds one update of `examples` examples, as the bound admits it. Returns
  // what the bound did to it ("norm ... scaled down to the bound ..."), or
  // empty; an error when it was refused, the strategy untouched. `owner`
  // keeps `values` alive: a strategy that holds updates until Finish (a
  // robust rule) keeps it instead of copying them (Strategy::FoldShared).
  // `work`: how the site trained, as its UpdateBegin said (FedNova reads it).
  // `control_delta`: SCAFFOLD's Δc_i, uploaded beside the delta; the bound
  // admits the delta, and Δc_i is folded as it came (aggregation::Scaffold::
  // FoldControl). Empty under every other strategy; a strategy that is not
  // SCAFFOLD refuses one, and SCAFFOLD refuses an update without one.
  Result<std::string> Fold(std::string_view client, const Manifest& layout, std::shared_ptr<const void> owner,
                           std::span<const float> values, uint64_t examples,
                           const aggregation::LocalWork& work = {}, std::span<const float> control_delta = {});
  // Folds a secure aggregation's mean (SecAgg+: the included sites'
  // example-weighted mean) as one update of weight `weight`, their examples
  // together. No bound applies: the sites clipped their updates themselves,
  // and a limit on one site's examples is checked against its weight when the
  // round starts.
  Status FoldMean(std::span<const float> mean, double weight) { return strategy_->Fold(mean, weight); }
  Finished Finish(uint64_t round, const GlobalModel& previous);
  // SCAFFOLD: c as the strategy holds it now (zeros before the first round,
  // or restored with the checkpoint); null under every other strategy.
  Result<std::shared_ptr<const std::vector<float>>> Control() const;
  // After the round log committed `round`: Checkpointer::MarkCommitted.
  Status MarkCommitted(uint64_t round) { return checkpointer_.MarkCommitted(round); }

  // Asynchronous rounds (FedBuff, aggregation/fedbuff.h): instead of
  // Begin/Fold/Finish, the accumulator at model `version` of `global` (the
  // committed version's values, restored or initial). The strategy (fedavg)
  // only names the checkpoints; the bound applies to every update and
  // advances with every version.
  // No version beyond `last` is stepped: an update after it is refused.
  Status BeginAsync(const aggregation::FedBuffOptions& options, uint64_t version,
                    std::shared_ptr<const std::vector<float>> global, uint64_t last);
  struct AsyncFolded {
    Status status;            // ok: folded; else refused, folding nothing
    bool stale = false;       // refused for staleness beyond max_staleness
    uint64_t version = 0;     // the version the server was at when it arrived
    uint64_t staleness = 0;   // version − trained_from
    double weight = 0;        // s(staleness); 0 when refused
    std::string note;         // what the bound did to it, if anything
    // The K-th folded update: the next version (version + 1), its checksum,
    // checkpoint and the server's evaluation of it, as Finish gives them.
    std::optional<Finished> step;
  };
  // Folds one update trained from `trained_from`: too stale, it is refused
  // before the bound sees it; then the bound admits it and FedBuff weights it.
  // The K-th steps the model at once, here, so the next update's staleness is
  // against the new version whatever the I/O thread has taken in.
  AsyncFolded FoldAsync(std::span<const float> values, uint64_t examples, uint64_t trained_from);

 private:
  // The new global model's checksum, checkpoint (with the strategy's and
  // the bound's state) and evaluation, side by side, into `result`.
  void Seal(uint64_t round, std::shared_ptr<std::vector<float>> global, std::string_view strategy, Finished& result);

  std::unique_ptr<aggregation::Strategy> strategy_;
  aggregation::UpdateBound bound_;
  std::unique_ptr<models::Evaluator> evaluator_;
  Checkpointer checkpointer_;
  Manifest manifest_;
  std::optional<aggregation::FedBuff> fedbuff_;                // under BeginAsync
  std::shared_ptr<const std::vector<float>> async_global_;  // fedbuff_'s version
  uint64_t async_last_ = 0;
};

}  // namespace estuary::server
