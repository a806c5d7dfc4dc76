#include "aggregation/fedavg.h"

#include <cmath>

namespace estuary::aggregation {

Status FedAvg::Apply(std::span<float> out) {
  const size_t n = start_.size();
  auto next = [&](size_t i) { return static_cast<float>(static_cast<double>(start_[i]) + mean_.Mean(i)); };
  // Check before writing so a model that would overflow float is refused
  // without clobbering `out` (which may alias the caller's global model).
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(next(i))) {
      return FailedPrecondition("aggregation: fedavg: round {}: parameter {} overflows float", round_, i);
    }
  }
  for (size_t i = 0; i < n; ++i) out[i] = next(i);
  return Status::Ok();
}

}  // namespace estuary::aggregation
