#include "aggregation/update_bound.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace estuary::aggregation {

namespace {

constexpr const char* kMedianKey = "update_bound/median_norm";

}  // namespace

UpdateBound::UpdateBound(const v1::UpdateLimits& limits) : limits_(limits) {}

void UpdateBound::BeginRound() {
  norms_.clear();
  bound_ = 0;
  double bound = limits_.max_norm() > 0 ? limits_.max_norm() : std::numeric_limits<double>::infinity();
  if (limits_.max_norm_over_median() > 0 && median_ > 0) {
    bound = std::min(bound, limits_.max_norm_over_median() * median_);
  }
  if (std::isfinite(bound)) bound_ = bound;
}

Result<UpdateBound::Admitted> UpdateBound::Admit(std::span<const float> values, uint64_t examples) {
  if (limits_.max_examples() > 0 && examples > limits_.max_examples()) {
    return InvalidArgument("update claims {} examples, beyond the federation's max_examples of {}", examples,
                           limits_.max_examples());
  }
  double squares = 0;
  for (float v : values) squares += double(v) * double(v);
  Admitted admitted;
  admitted.norm_ = std::sqrt(squares);
  if (!std::isfinite(admitted.norm_)) return InvalidArgument("update is not finite (its L2 norm is {})", admitted.norm_);
  admitted.values_ = values;
  if (bound_ > 0 && admitted.norm_ > bound_) {
    // The rare path: only an outlier pays for a copy.
    admitted.scale_ = bound_ / admitted.norm_;
    admitted.scaled_.assign(values.begin(), values.end());
    for (float& v : admitted.scaled_) v = float(double(v) * admitted.scale_);
    admitted.note_ = fmt::format("norm {:.4g} scaled down to the bound {:.4g}", admitted.norm_, bound_);
  }
  // The norm as folded: a scaled-down outlier cannot pull the next bound up.
  norms_.push_back(admitted.norm_ * admitted.scale_);
  return admitted;
}

void UpdateBound::CommitRound() {
  if (norms_.empty()) return;
  std::vector<double> sorted = norms_;
  const size_t middle = sorted.size() / 2;
  std::nth_element(sorted.begin(), sorted.begin() + middle, sorted.end());
  double median = sorted[middle];
  if (sorted.size() % 2 == 0) {
    median = (median + *std::max_element(sorted.begin(), sorted.begin() + middle)) / 2;
  }
  median_ = float(median);  // what the saved state holds, so a restart bounds alike
  norms_.clear();
}

std::map<std::string, std::vector<float>> UpdateBound::SaveState() const {
  if (median_ == 0) return {};
  return {{kMedianKey, {float(median_)}}};
}

Status UpdateBound::LoadState(const std::map<std::string, std::vector<float>>& state) {
  median_ = 0;
  auto it = state.find(kMedianKey);
  if (it == state.end()) return Status::Ok();
  if (it->second.size() != 1 || !(it->second[0] >= 0) || !std::isfinite(it->second[0])) {
    return InvalidArgument("update bound: saved state '{}' is not one finite norm", kMedianKey);
  }
  median_ = it->second[0];
  return Status::Ok();
}

}  // namespace estuary::aggregation
