// FedAvg (McMahan et al. 2017): the new global model is the old one plus the
// example-weighted mean of the client deltas,
//   new_global = global + Σ w_i Δ_i / Σ w_i.
// Stateless across rounds.
#pragma once

#include "aggregation/weighted_mean.h"

namespace estuary::aggregation {

class FedAvg final : public MeanDeltaStrategy {
 public:
  std::string_view name() const override { return "fedavg"; }

 private:
  Status Apply(std::span<float> out) override;
};

}  // namespace estuary::aggregation
