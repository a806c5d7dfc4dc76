#include "aggregation/robust_strategy.h"

#include <cmath>

#include "aggregation/weighted_mean.h"

namespace estuary::aggregation {

bool IsRobustStrategy(std::string_view name) {
  return name == "median" || name == "trimmed-mean" || name == "krum" || name == "multi-krum" || name == "bulyan";
}

Status RobustStrategy::Begin(uint64_t round, std::span<const float> global) {
  updates_.reset();  // a Begin while a round is open abandons it
  selection_.clear();
  if (global.empty()) return InvalidArgument("aggregation: {}: global model is empty", name());
  if (size_t bad = FirstNonFinite(global); bad != global.size()) {
    return InvalidArgument("aggregation: {}: global[{}] is {}", name(), bad, global[bad]);
  }
  start_.assign(global.begin(), global.end());
  updates_.emplace(global.size());
  round_ = round;
  return Status::Ok();
}

Status RobustStrategy::Fold(std::span<const float> delta, double weight) {
  ESTUARY_RETURN_IF_ERROR(Check(delta, weight));
  return updates_->Add(delta);
}

Status RobustStrategy::FoldShared(std::string_view client, const Manifest& layout, std::shared_ptr<const void> owner,
                                  std::span<const float> values, double weight) {
  ESTUARY_RETURN_IF_ERROR(Check(values, weight));
  return updates_->Keep(std::move(owner), values);
}

Status RobustStrategy::Check(std::span<const float> delta, double weight) const {
  if (!updates_) return FailedPrecondition("aggregation: {}: Fold outside a round (call Begin)", name());
  if (delta.size() != start_.size()) {
    return InvalidArgument("aggregation: delta has {} values but the model has {} (round {}, {})", delta.size(),
                           start_.size(), round_, name());
  }
  if (!std::isfinite(weight) || weight <= 0) {
    return InvalidArgument("aggregation: weight must be finite and > 0, got {} (round {}, {})", weight, round_, name());
  }
  if (size_t bad = FirstNonFinite(delta); bad != delta.size()) {
    return InvalidArgument("aggregation: delta[{}] is {} (round {}, {})", bad, delta[bad], round_, name());
  }
  return Status::Ok();
}

Status RobustStrategy::Finish(std::span<float> global) {
  if (!updates_) return FailedPrecondition("aggregation: {}: Finish outside a round (call Begin)", name());
  if (updates_->count() == 0) return FailedPrecondition("aggregation: {}: round {} has no folded update", name(), round_);
  if (global.size() != start_.size()) {
    return InvalidArgument("aggregation: {}: output has {} values but the model has {}", name(), global.size(),
                           start_.size());
  }
  std::vector<float> aggregate(start_.size());
  const size_t f = size_t(options_.byzantine);
  Status status;
  std::vector<size_t> selection;
  if (options_.name == "median") {
    status = CoordinateMedian(*updates_, aggregate);
  } else if (options_.name == "trimmed-mean") {
    status = TrimmedMean(*updates_, options_.trim, aggregate);
  } else if (options_.name == "bulyan") {
    auto chosen = Bulyan(*updates_, f, aggregate);
    status = chosen.status();
    if (chosen.ok()) selection = std::move(*chosen);
  } else {
    // krum is m = 1; multi-krum's m = 0 means n - f (Blanchard et al.'s largest).
    size_t m = 1;
    if (options_.name == "multi-krum") {
      m = options_.krum_select > 0 ? size_t(options_.krum_select)
                                   : (updates_->count() > f ? updates_->count() - f : 1);
    }
    auto chosen = MultiKrum(*updates_, f, m, aggregate);
    status = chosen.status();
    if (chosen.ok()) selection = std::move(*chosen);
  }
  if (!status.ok()) return {status.code(), fmt::format("{} (round {}, {})", status.message(), round_, name())};
  // Checked before anything is written: a failed Finish leaves `global` as it was.
  for (size_t i = 0; i < start_.size(); ++i) {
    if (!std::isfinite(start_[i] + aggregate[i])) {
      return FailedPrecondition("aggregation: {}: round {}: parameter {} overflows float", name(), round_, i);
    }
  }
  for (size_t i = 0; i < start_.size(); ++i) global[i] = start_[i] + aggregate[i];
  selection_ = std::move(selection);
  updates_.reset();
  return Status::Ok();
}

}  // namespace estuary::aggregation
