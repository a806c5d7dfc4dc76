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
// This first version keeps the deltas in memory: count × size floats for the
// round (10 updates of the 2NN's 199,210 parameters: 8 MB). The rules read
// them through an UpdateSource, block by block, so the next step is for the
// server to hand the rule its staged update files as the source instead of
// copying them here; until then only the in-process simulator runs these
// strategies (the server folds updates as they arrive and refuses them).
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
  uint64_t folded() const override { return updates_ ? updates_->count() : 0; }
  // Fails, writing nothing, when the rule's requirement on the number of
  // updates is not met (krum: n >= 2f + 3; bulyan: n >= 4f + 3), or the new
  // model would leave float's range.
  Status Finish(std::span<float> global) override;

  // The updates (by fold order) the last Finish of a krum, multi-krum or
  // bulyan round selected; empty for the coordinate-wise rules.
  const std::vector<size_t>& last_selection() const { return selection_; }

 private:
  StrategyOptions options_;
  std::vector<float> start_;
  std::optional<InMemoryUpdates> updates_;  // set while a round is open
  uint64_t round_ = 0;
  std::vector<size_t> selection_;
};

}  // namespace estuary::aggregation
