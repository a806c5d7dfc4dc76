#include "aggregation/strategy.h"

#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "aggregation/fedavg.h"
#include "aggregation/fedavgm.h"
#include "aggregation/fednova.h"
#include "aggregation/fedopt.h"
#include "aggregation/robust_strategy.h"
#include "aggregation/scaffold.h"

namespace estuary::aggregation {

double DefaultServerLr(std::string_view strategy) {
  return strategy == "fedavgm" || strategy == "scaffold" ? 1.0 : 0.01;
}

Status ValidateStrategyOptions(const StrategyOptions& options) {
  if (std::find(std::begin(kStrategyNames), std::end(kStrategyNames), options.name) == std::end(kStrategyNames)) {
    return InvalidArgument("aggregation: unknown strategy '{}' (known: {})", options.name,
                           fmt::join(kStrategyNames, ", "));
  }
  if (!std::isfinite(options.server_lr) || options.server_lr <= 0) {
    return InvalidArgument("aggregation: server_lr must be finite and > 0, got {}", options.server_lr);
  }
  // beta = 1 would freeze a moment at zero forever, and with bias correction
  // divide by 1 - 1^t = 0.
  if (!(options.beta1 >= 0 && options.beta1 < 1)) {
    return InvalidArgument("aggregation: beta1 must be in [0, 1), got {}", options.beta1);
  }
  if (!(options.beta2 >= 0 && options.beta2 < 1)) {
    return InvalidArgument("aggregation: beta2 must be in [0, 1), got {}", options.beta2);
  }
  // tau > 0 keeps m / (√v + τ) defined where v is zero.
  if (!std::isfinite(options.tau) || options.tau <= 0) {
    return InvalidArgument("aggregation: tau must be finite and > 0, got {}", options.tau);
  }
  if (!(options.server_momentum >= 0 && options.server_momentum < 1)) {
    return InvalidArgument("aggregation: server_momentum must be in [0, 1), got {}", options.server_momentum);
  }
  if (!(options.trim >= 0 && options.trim < 0.5)) {
    return InvalidArgument("aggregation: trim must be in [0, 0.5), got {}", options.trim);
  }
  // Beyond any federation's round; a typo rather than a setting.
  if (options.byzantine > 100000) {
    return InvalidArgument("aggregation: byzantine must be at most 100000, got {}", options.byzantine);
  }
  if (options.krum_select > 0 && options.name != "multi-krum") {
    return InvalidArgument("aggregation: krum_select = {} is multi-krum's; {} has none", options.krum_select,
                           options.name);
  }
  if (options.name == "scaffold" && options.total_sites == 0) {
    return InvalidArgument("aggregation: scaffold needs total_sites (N, the federation's sites, which its control "
                           "variate's update divides by)");
  }
  if (options.bias_correction && options.name != "fedadam") {
    return InvalidArgument("aggregation: bias_correction is Adam's; {} has none", options.name);
  }
  return Status::Ok();
}

Result<std::unique_ptr<Strategy>> MakeStrategy(const StrategyOptions& options) {
  ESTUARY_RETURN_IF_ERROR(ValidateStrategyOptions(options));
  if (options.name == "fedavg") return std::unique_ptr<Strategy>(std::make_unique<FedAvg>());
  if (IsRobustStrategy(options.name)) return std::unique_ptr<Strategy>(std::make_unique<RobustStrategy>(options));
  if (options.name == "scaffold") return std::unique_ptr<Strategy>(std::make_unique<Scaffold>(options));
  if (options.name == "fednova") return std::unique_ptr<Strategy>(std::make_unique<FedNova>());
  if (options.name == "fedavgm") return std::unique_ptr<Strategy>(std::make_unique<FedAvgM>(options));
  return std::unique_ptr<Strategy>(std::make_unique<FedOpt>(options));
}

}  // namespace estuary::aggregation
