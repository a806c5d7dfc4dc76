#include "aggregation/fednova.h"

#include <cmath>

namespace estuary::aggregation {
namespace {

// Beyond any site's round: a_i ≤ τ_i / (1 - momentum), and a million steps of
// a round is already a typo.
constexpr double kLargestNormalizer = 1e12;

Status NoWork(std::string_view client) {
  return InvalidArgument("aggregation: fednova: the update{}{} reports no local steps (its normalizer is unset); "
                         "FedNova needs each site's",
                         client.empty() ? "" : " from ", client);
}

}  // namespace

Status FedNova::Fold(std::span<const float> delta, double weight) { return NoWork(""); }

Status FedNova::FoldUpdate(std::string_view client, const Manifest& layout, std::span<const float> values,
                           double weight) {
  return NoWork(client);
}

Status FedNova::FoldShared(std::string_view client, const Manifest& layout, std::shared_ptr<const void> owner,
                           std::span<const float> values, double weight) {
  return NoWork(client);
}

Status FedNova::FoldWork(std::string_view client, const Manifest& layout, std::shared_ptr<const void> owner,
                         std::span<const float> values, double weight, const LocalWork& work) {
  const double a = work.normalizer;
  if (a == 0) return NoWork(client);
  if (!std::isfinite(a) || a < 0 || a > kLargestNormalizer) {
    return InvalidArgument("aggregation: fednova: the update from {} has normalizer {}: expected one in (0, {:g}]",
                           client, a, kLargestNormalizer);
  }
  if (!std::isfinite(weight) || weight <= 0) {
    return InvalidArgument("aggregation: fednova: the update from {} has weight {}: expected finite and > 0", client,
                           weight);
  }
  // Σ (w_i / a_i) Δ_i accumulates in the mean's sums; its own total weight
  // (Σ w_i / a_i) is not FedNova's denominator, which Apply forms from Σ w_i.
  ESTUARY_RETURN_IF_ERROR(MeanDeltaStrategy::Fold(values, weight / a));
  weight_sum_ += weight;
  work_sum_ += weight * a;
  return Status::Ok();
}

Status FedNova::OnBegin(size_t size) {
  weight_sum_ = 0;
  work_sum_ = 0;
  return Status::Ok();
}

Status FedNova::Apply(std::span<float> out) {
  const double tau_eff = work_sum_ / weight_sum_;
  const double scale = tau_eff / weight_sum_;
  const size_t n = start_.size();
  auto next = [&](size_t i) { return static_cast<float>(static_cast<double>(start_[i]) + scale * mean_.Sum(i)); };
  // A small a_i can carry a site's delta beyond float: check before writing.
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(next(i))) {
      return FailedPrecondition("aggregation: fednova: round {}: parameter {} overflows float", round_, i);
    }
  }
  for (size_t i = 0; i < n; ++i) out[i] = next(i);
  effective_steps_ = tau_eff;
  return Status::Ok();
}

}  // namespace estuary::aggregation
