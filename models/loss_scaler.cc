#include "models/loss_scaler.h"

#include <cmath>

namespace estuary::models {

bool UnscaleAndCheckFinite(std::span<float> grads, float inv_scale) {
  // No early exit: GradScaler unscales every gradient even after an inf, and
  // the check looks at the value before scaling (a huge finite gradient times
  // inv_scale is still what the optimizer would see).
  bool found_inf = false;
  for (float& g : grads) {
    found_inf |= !std::isfinite(g);
    g *= inv_scale;
  }
  return found_inf;
}

LossScaler::LossScaler(LossScalerOptions options) : options_(options), scale_(options.init_scale) {}

void LossScaler::Update(bool found_inf) {
  // torch's _amp_update_scale_: the products are taken in double and stored as fp32.
  if (found_inf) {
    scale_ = float(double(scale_) * options_.backoff_factor);
    growth_tracker_ = 0;
    return;
  }
  const int successful = growth_tracker_ + 1;
  if (successful == options_.growth_interval) {
    const float grown = float(double(scale_) * options_.growth_factor);
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  } else {
    growth_tracker_ = successful;
  }
}

}  // namespace estuary::models
