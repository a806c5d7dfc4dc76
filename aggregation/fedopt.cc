#include "aggregation/fedopt.h"

#include <cmath>
#include <limits>

namespace estuary::aggregation {
namespace {

// "step" travels as a float; beyond 2^24 consecutive integers stop being
// representable and a restart would no longer continue exactly.
constexpr uint64_t kMaxStep = uint64_t{1} << 24;

}  // namespace

FedOpt::FedOpt(const StrategyOptions& options)
    : options_(options),
      rule_(options.name == "fedyogi" ? Rule::kYogi : options.name == "fedadagrad" ? Rule::kAdagrad : Rule::kAdam) {}

double FedOpt::NextV(double v, double delta) const {
  const double square = delta * delta;
  switch (rule_) {
    case Rule::kYogi:
      // Moves v towards Δ² by (1-β2)Δ² whichever side it is on, so a large
      // v decays additively rather than geometrically as under Adam.
      return v - (1.0 - options_.beta2) * square * (v > square ? 1.0 : v < square ? -1.0 : 0.0);
    case Rule::kAdagrad:
      return v + square;
    case Rule::kAdam:
      break;
  }
  return options_.beta2 * v + (1.0 - options_.beta2) * square;
}

Status FedOpt::CheckDelta(std::span<const float> delta) const {
  ESTUARY_RETURN_IF_ERROR(MeanDeltaStrategy::CheckDelta(delta));
  static const float kLargest = std::sqrt(std::numeric_limits<float>::max());
  for (size_t i = 0; i < delta.size(); ++i) {
    if (std::abs(delta[i]) > kLargest) {
      return InvalidArgument("aggregation: {}: delta[{}] is {}: beyond {:.3g}, its square overflows the second "
                             "moment",
                             name(), i, delta[i], kLargest);
    }
  }
  return Status::Ok();
}

Status FedOpt::OnBegin(size_t size) {
  if (m_.empty()) {  // first round ever, or state reset: moments start at zero
    m_.assign(size, 0.0f);
    v_.assign(size, 0.0f);
    return Status::Ok();
  }
  if (m_.size() != size) {
    return FailedPrecondition("aggregation: {}: model has {} parameters but the optimizer state has {}", name(), size,
                              m_.size());
  }
  return Status::Ok();
}

Status FedOpt::Apply(std::span<float> out) {
  if (step_ + 1 > kMaxStep) {
    return FailedPrecondition("aggregation: {}: step counter exhausted ({})", name(), step_);
  }
  const double beta1 = options_.beta1;
  const double beta2 = options_.beta2;  // bias correction only: ValidateStrategyOptions keeps it to fedadam
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
    const double v = NextV(v_[i], delta);
    const double x = start_[i] + step_size * m / (std::sqrt(v) / sqrt_bc2 + tau);
    return Next{static_cast<float>(m), static_cast<float>(v), static_cast<float>(x)};
  };
  // Two passes so that a failure leaves the moments and `out` untouched; the
  // arithmetic is cheap next to the memory traffic.
  const size_t n = start_.size();
  for (size_t i = 0; i < n; ++i) {
    const Next s = next(i);
    if (!std::isfinite(s.m) || !std::isfinite(s.v) || !std::isfinite(s.x)) {
      return FailedPrecondition("aggregation: {}: round {}: parameter {} overflows float", name(), round_, i);
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

std::map<std::string, std::vector<float>> FedOpt::SaveState() const {
  if (m_.empty() && step_ == 0) return {};
  return {{"m", m_}, {"v", v_}, {"step", {static_cast<float>(step_)}}};
}

Status FedOpt::LoadState(const std::map<std::string, std::vector<float>>& state) {
  if (round_open()) return FailedPrecondition("aggregation: {}: LoadState during an open round", name());
  if (state.empty()) {
    m_.clear();
    v_.clear();
    step_ = 0;
    return Status::Ok();
  }
  for (const auto& [key, values] : state) {
    if (key != "m" && key != "v" && key != "step") {
      return InvalidArgument("aggregation: {} state: unknown tensor '{}'", name(), key);
    }
  }
  const auto m = state.find("m");
  const auto v = state.find("v");
  const auto step = state.find("step");
  if (m == state.end() || v == state.end() || step == state.end()) {
    return InvalidArgument("aggregation: {} state: needs 'm', 'v' and 'step'", name());
  }
  if (m->second.size() != v->second.size()) {
    return InvalidArgument("aggregation: {} state: 'm' has {} values but 'v' has {}", name(), m->second.size(),
                           v->second.size());
  }
  if (size_t bad = FirstNonFinite(m->second); bad != m->second.size()) {
    return InvalidArgument("aggregation: {} state: m[{}] is {}", name(), bad, m->second[bad]);
  }
  for (size_t i = 0; i < v->second.size(); ++i) {
    const float value = v->second[i];
    if (!std::isfinite(value) || value < 0) {
      return InvalidArgument("aggregation: {} state: v[{}] is {}, expected finite and >= 0", name(), i, value);
    }
  }
  if (step->second.size() != 1) {
    return InvalidArgument("aggregation: {} state: 'step' has {} values, expected 1", name(), step->second.size());
  }
  const float t = step->second[0];
  if (!(t >= 0) || t > static_cast<float>(kMaxStep) || t != std::floor(t)) {
    return InvalidArgument("aggregation: {} state: step {} is not an integer in [0, 2^24]", name(), t);
  }
  m_ = m->second;
  v_ = v->second;
  step_ = static_cast<uint64_t>(t);
  return Status::Ok();
}

}  // namespace estuary::aggregation
