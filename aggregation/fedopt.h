// FedOpt (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Alg. 2):
// the server steps along Δ, the example-weighted mean client delta, with
// moments kept across rounds:
//   m = β1 m + (1-β1) Δ
//   v = β2 v + (1-β2) Δ²                  fedadam
//   v = v - (1-β2) Δ² sign(v - Δ²)         fedyogi
//   v = v + Δ²                             fedadagrad (β2 unused)
//   x = x + η m / (√v + τ)
// m and v start at zero (the paper allows any v₀ ≥ τ²; zero makes the first
// step Adam's, as Flower's strategies do). Under fedadam, bias_correction
// replaces m and v by m/(1-β1^t) and v/(1-β2^t), t = rounds finished
// including this one, which is exactly torch.optim.Adam applied to the
// pseudo-gradient -Δ with lr=η and eps=τ.
//
// SaveState/LoadState carry m, v and t as "m", "v" and "step" (t stored as a
// float: exact up to 2^24 rounds) so a restarted server continues
// bit-for-bit. Moments are kept in float, the arithmetic of each step in
// double. A delta with a value beyond √FLT_MAX (~1.8e19) is refused at Fold:
// its square would overflow v, and the round could not finish; refused
// there, it is that site's update alone that fails.
#pragma once

#include "aggregation/weighted_mean.h"

namespace estuary::aggregation {

class FedOpt final : public MeanDeltaStrategy {
 public:
  // `options` must have passed ValidateStrategyOptions; its name, fedadam,
  // fedyogi or fedadagrad, picks the second moment's rule.
  explicit FedOpt(const StrategyOptions& options);
  std::string_view name() const override { return options_.name; }

  std::map<std::string, std::vector<float>> SaveState() const override;
  // An empty map resets to the initial state (zero moments, step 0).
  Status LoadState(const std::map<std::string, std::vector<float>>& state) override;

  uint64_t step() const { return step_; }

 private:
  Status OnBegin(size_t size) override;
  Status CheckDelta(std::span<const float> delta) const override;
  Status Apply(std::span<float> out) override;

  enum class Rule { kAdam, kYogi, kAdagrad };
  // The second moment after one more round whose mean delta is `delta`.
  double NextV(double v, double delta) const;

  StrategyOptions options_;
  Rule rule_;
  std::vector<float> m_;
  std::vector<float> v_;
  uint64_t step_ = 0;
};

}  // namespace estuary::aggregation
