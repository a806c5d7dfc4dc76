// RobustStrategy: a Byzantine-robust rule (robust.h) as a Strategy.
//
// Robust rules need all of a round's updates at once, so Fold keeps each
// delta and Finish applies the rule to them:
//   new_global = global + rule(deltas)
// with the rule one of median, trimmed-mean (StrategyOptions::trim), krum,
// multi-krum (byzantine f, krum_select m) and bulyan (f). The rules are
// unweighted, as in their papers: Fold checks the weight (finite, > 0) and
// then ignores it, since a Byzantine site could claim any number of examples.
//
// Fold copies each delta (count × size floats for the round: 10 updates of
// the 2NN's 199,210 parameters, 8 MB); the simulator folds this way.
// FoldShared keeps a view and its owner instead: the server hands over each
// staged update, which for a robust rule it always stages in a mapped file
// (server/coordinator.cc), so the round's updates stay on disk and in the
// page cache, and the rule reads them block by block (robust.h) with
// O(block × count) floats of its own.
//
// Stateless across rounds: SaveState is empty and a round's deltas are
// dropped at Finish or at the next Begin.
#pragma once

#include <optional>

#include "aggregation/robust.h"
#include "aggregation/strategy.h"

namespace estuary::aggregation {

// True for the strategies RobustStrategy runs.
bool IsRobustStrategy(std::string_view name);

class RobustStrategy final : public Strategy {
 public:
  // `options` must have passed ValidateStrategyOptions and name a robust strategy.
  explicit RobustStrategy(const StrategyOptions& options) : options_(options) {}
  std::string_view name() const override { return options_.name; }

  Status Begin(uint64_t round, std::span<const float> global) override;
  // Fails, keeping nothing, on a wrong size, a weight not finite and > 0, or
  // a value that is not finite.
  Status Fold(std::span<const float> delta, double weight) override;
  // The same checks; keeps `owner` and reads `values` at Finish, copying nothing.
  Status FoldShared(std::string_view client, const Manifest& layout, std::shared_ptr<const void> owner,
                    std::span<const float> values, double weight) override;
  uint64_t folded() const override { return updates_ ? updates_->count() : 0; }
  // Fails, writing nothing, when the rule's requirement on the number of
  // updates is not met (krum: n >= 2f + 3; bulyan: n >= 4f + 3), or the new
  // model would leave float's range.
  Status Finish(std::span<float> global) override;

  // The updates (by fold order) the last Finish of a krum, multi-krum or
  // bulyan round selected; empty for the coordinate-wise rules.
  const std::vector<size_t>& last_selection() const { return selection_; }
  // Floats of the open round's updates that Fold copied (FoldShared copies none).
  size_t copied_floats() const { return updates_ ? updates_->copied_floats() : 0; }

 private:
  StrategyOptions options_;
  std::vector<float> start_;
  Status Check(std::span<const float> delta, double weight) const;

  std::optional<KeptUpdates> updates_;  // set while a round is open
  uint64_t round_ = 0;
  std::vector<size_t> selection_;
};

}  // namespace estuary::aggregation
