// RecoverFederation: what either round driver (Coordinator,
// AsyncCoordinator) starts from. The federation built from the config, the
// round log checked against it (the model, the mode, DP on or off, with a DP
// federation's ε replayed), the checkpoint directory reconciled with the log
// and the last committed round's model loaded, or the initial model.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "aggregation/lora_strategy.h"
#include "base/manifest.h"
#include "base/status.h"
#include "privacy/accountant.h"
#include "privacy/distributed_dp.h"
#include "server/aggregator.h"
#include "server/config.h"
#include "server/global_model.h"
#include "server/store.h"

namespace estuary::server {

struct RecoveredFederation {
  v1::TaskConfig task;  // what every site trains (the federation's, as built)
  std::optional<aggregation::LoraStrategyOptions> lora;
  Manifest manifest;
  std::shared_ptr<const std::vector<float>> held_base;  // a Hugging Face base every site holds; null: none
  std::unique_ptr<Aggregator> aggregator;
  std::string federation_id;
  GlobalModel model;                      // the last committed round's, or the initial one (version 0)
  std::optional<RoundRecord> last;        // the last committed round; none in a new federation
  std::optional<privacy::Accountant> accountant;  // a DP federation's, the committed rounds replayed
  std::string custom_description;         // a custom model's summary line; empty: a zoo model
};

// Also records in the log's meta what it now holds: federation_id, model,
// strategy, mode, rounds, and complete = "" (not yet). Refuses a log of the
// other mode that has committed anything.
Result<RecoveredFederation> RecoverFederation(const ServerConfig& config, Store& store);

// Distributed DP (config.distributed_dp()): the plan of a round of `sites`
// sampled sites summing `dimension` elements (privacy::PlanDistributedDpShares with
// the config's z, clip, survivors and secagg_bits; the mean's denominator the
// sites sampled). Under Poisson sampling (sample_rate q) the plan is the run's,
// as estuary-sim's: the shares are calibrated for the expected q · total_sites
// and the ring has room for privacy::PoissonPlannedMaximum(total_sites, q),
// whatever the round drew. The same for a round as it runs and for its replay.
Result<privacy::DistributedDpPlan> DistributedDpPlanFor(const ServerConfig& config, uint32_t sites,
                                                        uint64_t dimension);

// The mean's fixed denominator under distributed DP: the sites sampled, or
// under Poisson sampling the expected q · total_sites.
double DistributedDpDenominator(const ServerConfig& config, uint32_t sites);

// Under Poisson sampling, refuses (one line naming the round and the counts)
// a draw of `sites` above the planned maximum, which the ring has no room
// for, or below the plan's min_included, whose sum would hold less noise
// than the plan promises. Ok without sampling.
Status DistributedDpDrawFits(const ServerConfig& config, uint64_t round, uint32_t sites,
                             const privacy::DistributedDpPlan& plan);

}  // namespace estuary::server
