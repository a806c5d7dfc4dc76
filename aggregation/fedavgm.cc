#include "aggregation/fedavgm.h"

#include <cmath>

namespace estuary::aggregation {

Status FedAvgM::OnBegin(size_t size) {
  if (momentum_.empty()) {
    momentum_.assign(size, 0.0f);
    return Status::Ok();
  }
  if (momentum_.size() != size) {
    return FailedPrecondition("aggregation: fedavgm: model has {} parameters but the momentum has {}", size,
                              momentum_.size());
  }
  return Status::Ok();
}

Status FedAvgM::Apply(std::span<float> out) {
  struct Next {
    float u, x;
  };
  auto next = [&](size_t i) {
    const double u = options_.server_momentum * momentum_[i] + mean_.Mean(i);
    // x from u in double, so that β = 0 and η = 1 round exactly as FedAvg does.
    return Next{static_cast<float>(u), static_cast<float>(start_[i] + options_.server_lr * u)};
  };
  // Checked first, so a failure leaves the momentum and `out` untouched.
  const size_t n = start_.size();
  for (size_t i = 0; i < n; ++i) {
    const Next s = next(i);
    if (!std::isfinite(s.u) || !std::isfinite(s.x)) {
      return FailedPrecondition("aggregation: fedavgm: round {}: parameter {} overflows float", round_, i);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const Next s = next(i);
    momentum_[i] = s.u;
    out[i] = s.x;
  }
  return Status::Ok();
}

std::map<std::string, std::vector<float>> FedAvgM::SaveState() const {
  if (momentum_.empty()) return {};
  return {{"momentum", momentum_}};
}

Status FedAvgM::LoadState(const std::map<std::string, std::vector<float>>& state) {
  if (round_open()) return FailedPrecondition("aggregation: fedavgm: LoadState during an open round");
  if (state.empty()) {
    momentum_.clear();
    return Status::Ok();
  }
  const auto it = state.find("momentum");
  if (state.size() != 1 || it == state.end()) {
    return InvalidArgument("aggregation: fedavgm state: needs exactly one tensor, 'momentum' (got '{}')",
                           state.begin()->first);
  }
  if (size_t bad = FirstNonFinite(it->second); bad != it->second.size()) {
    return InvalidArgument("aggregation: fedavgm state: momentum[{}] is {}", bad, it->second[bad]);
  }
  momentum_ = it->second;
  return Status::Ok();
}

}  // namespace estuary::aggregation
