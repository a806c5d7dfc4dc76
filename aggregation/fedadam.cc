#include "aggregation/fedadam.h"

#include <cmath>
#include <limits>

namespace estuary::aggregation {
namespace {

// "step" travels as a float; beyond 2^24 consecutive integers stop being
// representable and a restart would no longer continue exactly.
constexpr uint64_t kMaxStep = uint64_t{1} << 24;

}  // namespace

FedAdam::FedAdam(const StrategyOptions& options) : options_(options) {}

Status FedAdam::CheckDelta(std::span<const float> delta) const {
  ESTUARY_RETURN_IF_ERROR(MeanDeltaStrategy::CheckDelta(delta));
  static const float kLargest = std::sqrt(std::numeric_limits<float>::max());
  for (size_t i = 0; i < delta.size(); ++i) {
    if (std::abs(delta[i]) > kLargest) {
      return InvalidArgument("aggregation: fedadam: delta[{}] is {}: beyond {:.3g}, its square overflows the second "
                             "moment",
                             i, delta[i], kLargest);
    }
  }
  return Status::Ok();
}

Status FedAdam::OnBegin(size_t size) {
  if (m_.empty()) {  // first round ever, or state reset: moments start at zero
    m_.assign(size, 0.0f);
    v_.assign(size, 0.0f);
    return Status::Ok();
  }
  if (m_.size() != size) {
    return FailedPrecondition("aggregation: fedadam: model has {} parameters but the optimizer state has {}", size,
                              m_.size());
  }
  return Status::Ok();
}

Status FedAdam::Apply(std::span<float> out) {
  if (step_ + 1 > kMaxStep) return FailedPrecondition("aggregation: fedadam: step counter exhausted ({})", step_);
  const double beta1 = options_.beta1;
  const double beta2 = options_.beta2;
  const double tau = options_.tau;
  const double t = static_cast<double>(step_ + 1);
  // Without bias correction both factors are 1 and the update is Reddi et
  // al.'s. With it, the form follows torch.optim.Adam term for term
  // (lr/bc1 * m / (√v/√bc2 + eps)) so the two agree to rounding.
  const double step_size = options_.bias_correction ? options_.server_lr / (1.0 - std::pow(beta1, t))
                                                    : options_.server_lr;
  const double sqrt_bc2 = options_.bias_correction ? std::sqrt(1.0 - std::pow(beta2, t)) : 1.0;

  struct Next {
    float m, v, x;
  };
  auto next = [&](size_t i) {
    const double delta = mean_.Mean(i);
    const double m = beta1 * m_[i] + (1.0 - beta1) * delta;
    const double v = beta2 * v_[i] + (1.0 - beta2) * delta * delta;
    const double x = start_[i] + step_size * m / (std::sqrt(v) / sqrt_bc2 + tau);
    return Next{static_cast<float>(m), static_cast<float>(v), static_cast<float>(x)};
  };
  // Two passes so that a failure leaves the moments and `out` untouched; the
  // arithmetic is cheap next to the memory traffic.
  const size_t n = start_.size();
  for (size_t i = 0; i < n; ++i) {
    const Next s = next(i);
    if (!std::isfinite(s.m) || !std::isfinite(s.v) || !std::isfinite(s.x)) {
      return FailedPrecondition("aggregation: fedadam: round {}: parameter {} overflows float", round_, i);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const Next s = next(i);
    m_[i] = s.m;
    v_[i] = s.v;
    out[i] = s.x;
  }
  ++step_;
  return Status::Ok();
}

std::map<std::string, std::vector<float>> FedAdam::SaveState() const {
  if (m_.empty() && step_ == 0) return {};
  return {{"m", m_}, {"v", v_}, {"step", {static_cast<float>(step_)}}};
}

Status FedAdam::LoadState(const std::map<std::string, std::vector<float>>& state) {
  if (round_open()) return FailedPrecondition("aggregation: fedadam: LoadState during an open round");
  if (state.empty()) {
    m_.clear();
    v_.clear();
    step_ = 0;
    return Status::Ok();
  }
  for (const auto& [key, values] : state) {
    if (key != "m" && key != "v" && key != "step") {
      return InvalidArgument("aggregation: fedadam state: unknown tensor '{}'", key);
    }
  }
  const auto m = state.find("m");
  const auto v = state.find("v");
  const auto step = state.find("step");
  if (m == state.end() || v == state.end() || step == state.end()) {
    return InvalidArgument("aggregation: fedadam state: needs 'm', 'v' and 'step'");
  }
  if (m->second.size() != v->second.size()) {
    return InvalidArgument("aggregation: fedadam state: 'm' has {} values but 'v' has {}", m->second.size(),
                           v->second.size());
  }
  if (size_t bad = FirstNonFinite(m->second); bad != m->second.size()) {
    return InvalidArgument("aggregation: fedadam state: m[{}] is {}", bad, m->second[bad]);
  }
  for (size_t i = 0; i < v->second.size(); ++i) {
    const float value = v->second[i];
    if (!std::isfinite(value) || value < 0) {
      return InvalidArgument("aggregation: fedadam state: v[{}] is {}, expected finite and >= 0", i, value);
    }
  }
  if (step->second.size() != 1) {
    return InvalidArgument("aggregation: fedadam state: 'step' has {} values, expected 1", step->second.size());
  }
  const float t = step->second[0];
  if (!(t >= 0) || t > static_cast<float>(kMaxStep) || t != std::floor(t)) {
    return InvalidArgument("aggregation: fedadam state: step {} is not an integer in [0, 2^24]", t);
  }
  m_ = m->second;
  v_ = v->second;
  step_ = static_cast<uint64_t>(t);
  return Status::Ok();
}

}  // namespace estuary::aggregation
