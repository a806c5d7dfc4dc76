#include "aggregation/weighted_mean.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <thread>
#include <vector>

namespace estuary::aggregation {
namespace {

// True if every value is finite. Tests the exponent bits with an integer OR
// reduction, which the compiler vectorises (a float comparison loop with an
// early exit would not be), so validating costs far less than accumulating.
bool AllFinite(std::span<const float> values) {
  constexpr uint32_t kExponent = 0x7f800000u;
  uint32_t any_non_finite = 0;
  for (float value : values) {
    const uint32_t bits = std::bit_cast<uint32_t>(value);
    any_non_finite |= static_cast<uint32_t>((bits & kExponent) == kExponent);
  }
  return any_non_finite == 0;
}

// Runs fn(begin, end) over `threads` contiguous ranges of [0, n), the last on
// the calling thread. Small ranges stay on one thread: starting one costs
// tens of microseconds.
template <typename Fn>
void OverRanges(size_t n, int threads, const Fn& fn) {
  constexpr size_t kMinPerThread = size_t(1) << 18;
  const size_t t = std::max<size_t>(1, std::min<size_t>(size_t(threads), n / kMinPerThread));
  if (t == 1) return fn(size_t(0), n);
  std::vector<std::thread> helpers;
  const size_t per = (n + t - 1) / t;
  for (size_t i = 0; i + 1 < t; ++i) helpers.emplace_back(fn, i * per, std::min(n, (i + 1) * per));
  fn((t - 1) * per, n);
  for (auto& h : helpers) h.join();
}

}  // namespace

size_t FirstNonFinite(std::span<const float> values) {
  if (AllFinite(values)) return values.size();
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) return i;
  }
  return values.size();
}

void WeightedMean::Reset(size_t size) {
  sums_.assign(size, 0.0);
  total_weight_ = 0;
  count_ = 0;
}

Status WeightedMean::Add(std::span<const float> delta, double weight) {
  if (delta.size() != sums_.size()) {
    return InvalidArgument("aggregation: delta has {} values but the model has {}", delta.size(), sums_.size());
  }
  if (!std::isfinite(weight) || weight <= 0) {
    return InvalidArgument("aggregation: weight must be finite and > 0, got {}", weight);
  }
  const size_t n = delta.size();
  std::atomic<bool> finite{true};
  OverRanges(n, threads_, [&](size_t begin, size_t end) {
    if (!AllFinite(delta.subspan(begin, end - begin))) finite.store(false, std::memory_order_relaxed);
  });
  if (!finite.load()) {
    const size_t bad = FirstNonFinite(delta);
    return InvalidArgument("aggregation: delta[{}] is {}", bad, delta[bad]);
  }
  double* sums = sums_.data();
  const float* values = delta.data();
  OverRanges(n, threads_, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) sums[i] += weight * static_cast<double>(values[i]);
  });
  total_weight_ += weight;
  ++count_;
  return Status::Ok();
}

Status MeanDeltaStrategy::Begin(uint64_t round, std::span<const float> global) {
  // A Begin while a round is open abandons that round: the server restarts a
  // round it could not complete.
  round_open_ = false;
  if (global.empty()) return InvalidArgument("aggregation: {}: global model is empty", name());
  if (size_t bad = FirstNonFinite(global); bad != global.size()) {
    return InvalidArgument("aggregation: {}: global[{}] is {}", name(), bad, global[bad]);
  }
  ESTUARY_RETURN_IF_ERROR(OnBegin(global.size()));
  start_.assign(global.begin(), global.end());
  mean_.Reset(global.size());
  round_ = round;
  round_open_ = true;
  return Status::Ok();
}

Status MeanDeltaStrategy::CheckDelta(std::span<const float> delta) const {
  if (delta.size() != start_.size()) return Status::Ok();  // WeightedMean::Add names the size
  for (size_t i = 0; i < delta.size(); ++i) {
    const double moved = double(start_[i]) + double(delta[i]);
    if (std::isfinite(delta[i]) && !std::isfinite(float(moved))) {
      return InvalidArgument("aggregation: {}: delta[{}] = {} takes the parameter to {}, beyond float", name(), i,
                             delta[i], moved);
    }
  }
  return Status::Ok();
}

Status MeanDeltaStrategy::Fold(std::span<const float> delta, double weight) {
  if (!round_open_) return FailedPrecondition("aggregation: {}: Fold outside a round (call Begin)", name());
  Status status = CheckDelta(delta);
  if (status.ok()) status = mean_.Add(delta, weight);
  if (!status.ok()) return {status.code(), fmt::format("{} (round {}, {})", status.message(), round_, name())};
  return Status::Ok();
}

Status MeanDeltaStrategy::Finish(std::span<float> global) {
  if (!round_open_) return FailedPrecondition("aggregation: {}: Finish outside a round (call Begin)", name());
  if (mean_.count() == 0) return FailedPrecondition("aggregation: {}: round {} has no folded update", name(), round_);
  if (global.size() != start_.size()) {
    return InvalidArgument("aggregation: {}: output has {} values but the model has {}", name(), global.size(),
                           start_.size());
  }
  ESTUARY_RETURN_IF_ERROR(Apply(global));
  round_open_ = false;
  return Status::Ok();
}

}  // namespace estuary::aggregation
