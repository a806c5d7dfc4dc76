#include "aggregation/strategy.h"

#include <cmath>

#include "aggregation/fedadam.h"
#include "aggregation/fedavg.h"

namespace estuary::aggregation {

Status ValidateStrategyOptions(const StrategyOptions& options) {
  if (options.name != "fedavg" && options.name != "fedadam") {
    return InvalidArgument("aggregation: unknown strategy '{}' (known: fedavg, fedadam)", options.name);
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
  return Status::Ok();
}

Result<std::unique_ptr<Strategy>> MakeStrategy(const StrategyOptions& options) {
  ESTUARY_RETURN_IF_ERROR(ValidateStrategyOptions(options));
  if (options.name == "fedadam") return std::unique_ptr<Strategy>(std::make_unique<FedAdam>(options));
  return std::unique_ptr<Strategy>(std::make_unique<FedAvg>());
}

}  // namespace estuary::aggregation
