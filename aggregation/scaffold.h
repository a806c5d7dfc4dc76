// SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging
// for Federated Learning", ICML 2020, Algorithm 1, option II): the server
// keeps a control variate c, an estimate of the global update direction;
// each site keeps its own c_i, corrects every local gradient by (c - c_i)
// (client/scaffold.h) and uploads its control delta Δc_i beside its model
// delta Δy_i. The server steps
//   x ← x + η_g · Σ w_i Δy_i / Σ w_i
//   c ← c + (1/N) · Σ_{i∈S} Δc_i       (= (|S|/N) · mean Δc_i)
// with w_i the site's examples (the paper's unweighted mean when they are
// equal), η_g the server learning rate (server_lr, 1 by default) and N the
// federation's sites (total_sites; the simulator sets its client count).
//
// Updates come through FoldControl, the control delta with the model delta;
// Fold and its relatives carry none and are refused. c starts at zero and is
// checkpointed (SaveState "c"), so a restarted server continues bit for bit.
#pragma once

#include "aggregation/weighted_mean.h"

namespace estuary::aggregation {

class Scaffold final : public MeanDeltaStrategy {
 public:
  // `options` passed ValidateStrategyOptions: total_sites > 0.
  explicit Scaffold(const StrategyOptions& options);
  std::string_view name() const override { return "scaffold"; }

  // The c the sites of the next round correct by: zeros of `size` values
  // before the first round (or after a reset). Fails if the state holds
  // another size.
  Result<std::vector<float>> Control(size_t size) const;

  // Folds one site's model delta and its control delta (both of the global
  // model's size, finite); a refused pair changes nothing.
  Status FoldControl(std::string_view client, std::span<const float> delta, std::span<const float> control_delta,
                     double weight);

  Status Fold(std::span<const float> delta, double weight) override;
  Status FoldUpdate(std::string_view client, const Manifest& layout, std::span<const float> values,
                    double weight) override;
  Status FoldShared(std::string_view client, const Manifest& layout, std::shared_ptr<const void> owner,
                    std::span<const float> values, double weight) override;

  std::map<std::string, std::vector<float>> SaveState() const override;
  // An empty map resets c to zero.
  Status LoadState(const std::map<std::string, std::vector<float>>& state) override;

 private:
  Status OnBegin(size_t size) override;
  Status Apply(std::span<float> out) override;

  StrategyOptions options_;
  std::vector<float> control_;          // c; empty: zero, not yet sized
  std::vector<double> control_sum_;     // Σ Δc_i over the round's folds
};

}  // namespace estuary::aggregation
