// FedNova (Wang et al., "Tackling the Objective Inconsistency Problem in
// Heterogeneous Federated Optimization", NeurIPS 2020, eq. 6 and 8): sites
// that took more local steps move further, and FedAvg's mean lets them pull
// the model towards their own objective. FedNova folds each delta divided by
// its site's normaliser a_i and rescales the mean by the effective step count:
//   Δ = τ_eff · Σ p_i Δ_i / a_i,   τ_eff = Σ p_i a_i,   p_i = w_i / Σ w_j
// with w_i the site's weight (its examples) over the round's folded updates
// and a_i = ‖a_i‖₁ as the site reports it (LocalWork.normalizer; for plain
// SGD a_i = τ_i, client/local_work.h for momentum and decay). With every
// a_i equal this is FedAvg to rounding.
//
// Updates must come through FoldWork with a normaliser > 0: Fold and
// FoldUpdate carry none and are refused. Stateless across rounds.
#pragma once

#include "aggregation/weighted_mean.h"

namespace estuary::aggregation {

class FedNova final : public MeanDeltaStrategy {
 public:
  std::string_view name() const override { return "fednova"; }

  Status Fold(std::span<const float> delta, double weight) override;
  Status FoldUpdate(std::string_view client, const Manifest& layout, std::span<const float> values,
                    double weight) override;
  Status FoldShared(std::string_view client, const Manifest& layout, std::shared_ptr<const void> owner,
                    std::span<const float> values, double weight) override;
  Status FoldWork(std::string_view client, const Manifest& layout, std::shared_ptr<const void> owner,
                  std::span<const float> values, double weight, const LocalWork& work) override;

  // After Finish: the round's τ_eff.
  double effective_steps() const { return effective_steps_; }

 private:
  Status OnBegin(size_t size) override;
  Status Apply(std::span<float> out) override;

  double weight_sum_ = 0;      // Σ w_i
  double work_sum_ = 0;        // Σ w_i a_i
  double effective_steps_ = 0;
};

}  // namespace estuary::aggregation
