// FedAvgM (Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data
// Distribution for Federated Visual Classification", 2019): FedAvg with
// momentum on the server. With Δ the example-weighted mean client delta,
//   u = β u + Δ
//   x = x + η u
// so β = 0 and η = 1 is FedAvg, and the update is torch.optim.SGD with
// momentum β (dampening 0) applied to the pseudo-gradient -Δ with lr η.
//
// u starts at zero and persists across rounds; SaveState/LoadState carry it
// as "momentum" so a restarted server continues bit-for-bit. u is kept in
// float, each step's arithmetic in double.
#pragma once

#include "aggregation/weighted_mean.h"

namespace estuary::aggregation {

class FedAvgM final : public MeanDeltaStrategy {
 public:
  // `options` must have passed ValidateStrategyOptions.
  explicit FedAvgM(const StrategyOptions& options) : options_(options) {}
  std::string_view name() const override { return "fedavgm"; }

  std::map<std::string, std::vector<float>> SaveState() const override;
  // An empty map resets to zero momentum.
  Status LoadState(const std::map<std::string, std::vector<float>>& state) override;

 private:
  Status OnBegin(size_t size) override;
  Status Apply(std::span<float> out) override;

  StrategyOptions options_;
  std::vector<float> momentum_;
};

}  // namespace estuary::aggregation
