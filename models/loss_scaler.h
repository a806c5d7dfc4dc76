// Dynamic loss scaling for mixed-precision training, with the semantics of
// torch.cuda.amp.GradScaler (defaults included).
//
// The loss is multiplied by scale() before backward, so small fp16/bf16
// gradients do not flush to zero. Before the optimizer step the gradients are
// unscaled (multiplied by inv_scale()) and checked for inf/NaN. A step that
// found one is skipped — the weights and the optimizer state are not touched —
// the scale backs off (x0.5) and the count of clean steps restarts; after
// growth_interval consecutive clean steps the scale grows (x2) unless that
// would overflow fp32. The state machine is backend-neutral: CUDA training
// computes the found-inf flag on the device (models/cuda/precision.h), reads it
// once per step and calls Update() with it.
#pragma once

#include <cstdint>
#include <span>
#include <utility>

namespace estuary::models {

struct LossScalerOptions {
  float init_scale = 65536.0f;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int growth_interval = 2000;
};

// Multiplies every gradient by inv_scale in place and returns whether any of
// them was inf or NaN before scaling (GradScaler.unscale_).
bool UnscaleAndCheckFinite(std::span<float> grads, float inv_scale);

class LossScaler {
 public:
  explicit LossScaler(LossScalerOptions options = {});

  float scale() const { return scale_; }
  // 1/scale rounded once to fp32, as GradScaler computes it (in double).
  float inv_scale() const { return float(1.0 / double(scale_)); }
  // Clean steps since the last growth or backoff.
  int growth_tracker() const { return growth_tracker_; }

  // Records one step's outcome (GradScaler.update).
  void Update(bool found_inf);

  // GradScaler.step followed by update, on the CPU: unscales grads in place,
  // calls optimizer_step() only when all of them are finite, then updates the
  // scale. Returns whether the optimizer step ran.
  template <typename OptimizerStep>
  bool Step(std::span<float> grads, OptimizerStep&& optimizer_step) {
    const bool found_inf = UnscaleAndCheckFinite(grads, inv_scale());
    if (!found_inf) std::forward<OptimizerStep>(optimizer_step)();
    Update(found_inf);
    return !found_inf;
  }

 private:
  LossScalerOptions options_;
  float scale_;
  int growth_tracker_ = 0;
};

}  // namespace estuary::models
