// WeightedMean: the streaming Σ w_i Δ_i / Σ w_i that FedAvg and FedAdam share.
//
// Holds one double per parameter however many deltas are added; each delta is
// validated (size, weight, finiteness) before any of it is accumulated, so a
// rejected delta leaves the sums bit-for-bit as they were.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "aggregation/strategy.h"
#include "base/status.h"

namespace estuary::aggregation {

class WeightedMean {
 public:
  // Add splits the model's range over this many threads (its own and
  // threads - 1 more); each element's arithmetic is the same whatever the
  // count, so the sums are bit-for-bit those of one thread.
  void set_threads(int threads) { threads_ = threads < 1 ? 1 : threads; }

  // Forgets everything and expects deltas of `size` values.
  void Reset(size_t size);
  // Adds weight * delta. Fails, changing nothing, unless delta.size() == size(),
  // weight is finite and > 0, and every value of delta is finite.
  Status Add(std::span<const float> delta, double weight);

  size_t size() const { return sums_.size(); }
  uint64_t count() const { return count_; }
  double total_weight() const { return total_weight_; }
  // The weighted mean of value i; meaningful only when count() > 0.
  double Mean(size_t i) const { return sums_[i] / total_weight_; }
  // Σ w_i Δ_i of value i.
  double Sum(size_t i) const { return sums_[i]; }

 private:
  std::vector<double> sums_;  // Σ w_i Δ_i, in double so many folds lose nothing visible in float
  double total_weight_ = 0;
  uint64_t count_ = 0;
  int threads_ = 1;
};

// The round bookkeeping shared by strategies whose update is a function of the
// global model and the weighted mean delta: Begin copies the global model and
// resets the mean, Fold adds to it, Finish checks a round is open with at
// least one fold and hands over to Apply.
class MeanDeltaStrategy : public Strategy {
 public:
  Status Begin(uint64_t round, std::span<const float> global) override;
  Status Fold(std::span<const float> delta, double weight) override;
  uint64_t folded() const override { return mean_.count(); }
  Status Finish(std::span<float> global) override;

 protected:
  // Hook for Begin, after the base checks, e.g. to size cross-round state.
  virtual Status OnBegin(size_t size) { return Status::Ok(); }
  // Hook for Fold, before anything is added: refuses a delta this strategy
  // could not finish without overflowing, so a refused delta is that one
  // update's failure, not the round's. A refused delta changes nothing. By
  // default: a delta that would take a parameter beyond float's range
  // (the round's mean is a convex combination of the deltas, so when none
  // does, the new model cannot either).
  virtual Status CheckDelta(std::span<const float> delta) const;
  // Writes the new model into `out` (size checked). Must not write anything
  // if it fails.
  virtual Status Apply(std::span<float> out) = 0;
  bool round_open() const { return round_open_; }

  std::vector<float> start_;  // the global model given to Begin
  WeightedMean mean_;
  uint64_t round_ = 0;

 private:
  bool round_open_ = false;
};

// Index of the first non-finite value, or values.size() if all are finite.
size_t FirstNonFinite(std::span<const float> values);

}  // namespace estuary::aggregation
