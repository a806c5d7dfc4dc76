#include "aggregation/scaffold.h"

#include <cmath>

namespace estuary::aggregation {
namespace {

Status NoControl(std::string_view client) {
  return InvalidArgument("aggregation: scaffold: the update{}{} carries no control delta; SCAFFOLD needs each "
                         "site's Δc beside its model delta",
                         client.empty() ? "" : " from ", client);
}

}  // namespace

Scaffold::Scaffold(const StrategyOptions& options) : options_(options) {}

Result<std::vector<float>> Scaffold::Control(size_t size) const {
  if (control_.empty()) return std::vector<float>(size, 0.0f);
  if (control_.size() != size) {
    return FailedPrecondition("aggregation: scaffold: model has {} parameters but the control variate has {}", size,
                              control_.size());
  }
  return control_;
}

Status Scaffold::Fold(std::span<const float> delta, double weight) { return NoControl(""); }

Status Scaffold::FoldUpdate(std::string_view client, const Manifest& layout, std::span<const float> values,
                            double weight) {
  return NoControl(client);
}

Status Scaffold::FoldShared(std::string_view client, const Manifest& layout, std::shared_ptr<const void> owner,
                            std::span<const float> values, double weight) {
  return NoControl(client);
}

Status Scaffold::FoldControl(std::string_view client, std::span<const float> delta,
                             std::span<const float> control_delta, double weight) {
  if (!round_open()) return FailedPrecondition("aggregation: scaffold: Fold outside a round (call Begin)");
  if (control_delta.size() != start_.size()) {
    return InvalidArgument("aggregation: scaffold: the control delta from {} has {} values but the model has {} "
                           "(round {})",
                           client, control_delta.size(), start_.size(), round_);
  }
  if (size_t bad = FirstNonFinite(control_delta); bad != control_delta.size()) {
    return InvalidArgument("aggregation: scaffold: the control delta from {} has [{}] = {} (round {})", client, bad,
                           control_delta[bad], round_);
  }
  // The model delta's own checks (size, weight, finite, range) come first:
  // once it is in, the control delta, already checked, cannot fail.
  ESTUARY_RETURN_IF_ERROR(MeanDeltaStrategy::Fold(delta, weight));
  for (size_t i = 0; i < control_delta.size(); ++i) control_sum_[i] += double(control_delta[i]);
  return Status::Ok();
}

Status Scaffold::OnBegin(size_t size) {
  if (!control_.empty() && control_.size() != size) {
    return FailedPrecondition("aggregation: scaffold: model has {} parameters but the control variate has {}", size,
                              control_.size());
  }
  control_sum_.assign(size, 0.0);
  return Status::Ok();
}

Status Scaffold::Apply(std::span<float> out) {
  const size_t n = start_.size();
  const double eta = options_.server_lr;
  const double per_site = 1.0 / double(options_.total_sites);
  auto x = [&](size_t i) { return static_cast<float>(double(start_[i]) + eta * mean_.Mean(i)); };
  auto c = [&](size_t i) {
    return static_cast<float>((control_.empty() ? 0.0 : double(control_[i])) + per_site * control_sum_[i]);
  };
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(x(i)) || !std::isfinite(c(i))) {
      return FailedPrecondition("aggregation: scaffold: round {}: parameter {} overflows float", round_, i);
    }
  }
  std::vector<float> next(n);
  for (size_t i = 0; i < n; ++i) next[i] = c(i);
  for (size_t i = 0; i < n; ++i) out[i] = x(i);
  control_ = std::move(next);
  return Status::Ok();
}

std::map<std::string, std::vector<float>> Scaffold::SaveState() const {
  if (control_.empty()) return {};
  return {{"c", control_}};
}

Status Scaffold::LoadState(const std::map<std::string, std::vector<float>>& state) {
  if (round_open()) return FailedPrecondition("aggregation: scaffold: LoadState during an open round");
  if (state.empty()) {
    control_.clear();
    return Status::Ok();
  }
  for (const auto& [key, values] : state) {
    if (key != "c") return InvalidArgument("aggregation: scaffold state: unknown tensor '{}'", key);
  }
  const std::vector<float>& c = state.at("c");
  if (c.empty()) return InvalidArgument("aggregation: scaffold state: 'c' is empty");
  if (size_t bad = FirstNonFinite(c); bad != c.size()) {
    return InvalidArgument("aggregation: scaffold state: c[{}] is {}", bad, c[bad]);
  }
  control_ = c;
  return Status::Ok();
}

}  // namespace estuary::aggregation
