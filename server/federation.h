// The federation a server runs, built from its config: the initial global
// model, the strategy that merges the sites' updates, the evaluator that
// scores each new global model, and the LoRA options of a lora federation.
#pragma once

#include <memory>
#include <optional>

#include "aggregation/lora_strategy.h"
#include "aggregation/strategy.h"
#include "base/status.h"
#include "models/federated_model.h"
#include "server/config.h"

namespace estuary::server {

struct Federation {
  models::InitialWeights initial;  // the model before round 1, and its layout
  std::unique_ptr<aggregation::Strategy> strategy;
  std::optional<aggregation::LoraStrategyOptions> lora;  // set in a federation of update kind lora
  std::unique_ptr<models::Evaluator> evaluator;          // null without eval data
};

// Reads config.task, .strategy, .seed, .base_model, .eval_data and
// .eval_windows; errors name what was wrong.
Result<Federation> BuildFederation(const ServerConfig& config);

}  // namespace estuary::server
