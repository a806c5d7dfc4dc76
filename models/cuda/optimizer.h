// Fused optimizers and gradient clipping over flat device buffers.
//
// cuda::AdamW and cuda::Sgd are the device twins of models::AdamW and
// models::Sgd (torch.optim semantics, the same options): one kernel reads the
// parameters, gradients and optimizer state once and writes parameters and
// state back, and, given a WorkingCopy, also the updated parameters in
// bf16/fp16 — the mixed-precision working copy without a second sweep. The
// state is allocated and zeroed by Create, never inside Step, and Step only
// enqueues work on its stream. ClipGradNorm is clip_grad_norm_ over the whole
// flat gradient buffer; the norm and the coefficient stay on the device, so
// clipping costs no host round trip.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

#include "base/status.h"
#include "models/cuda/device.h"
#include "models/optimizer.h"
#include "models/tensor.h"

namespace estuary::models::cuda {

// Where a step also writes the new parameters in low precision (same layout).
struct WorkingCopy {
  void* data = nullptr;  // null: no working copy
  DType dtype = DType::kBF16;
};

class AdamW {
 public:
  AdamW() = default;
  // Moments for `count` parameters, zeroed on `stream`.
  static Result<AdamW> Create(int64_t count, AdamWOptions options, cudaStream_t stream);

  // params and grads hold the `count` elements given to Create.
  Status Step(float* params, const float* grads, cudaStream_t stream, WorkingCopy working = {});
  // One step over device slices holding `count` elements in all (a ZeRO
  // rank's pieces, models::ParameterSlice): one kernel per slice.
  Status Step(std::span<const ParameterSlice> slices, cudaStream_t stream);

  void set_lr(float lr) { options_.lr = lr; }
  const AdamWOptions& options() const { return options_; }
  int64_t step_count() const { return step_; }
  int64_t size() const { return count_; }
  const float* first_moment() const { return moments_.as<float>(); }
  const float* second_moment() const { return moments_.as<float>() + count_; }

  // The moments and step count to and from host memory (`count` floats each),
  // so that a run saved and reloaded continues exactly as it would have.
  // SaveState waits for `stream`.
  Status SaveState(std::span<float> first, std::span<float> second, cudaStream_t stream) const;
  Status LoadState(std::span<const float> first, std::span<const float> second, int64_t step_count,
                   cudaStream_t stream);

 private:
  Status StepSlices(std::span<const ParameterSlice> slices, WorkingCopy working, cudaStream_t stream);

  AdamWOptions options_;
  int64_t count_ = 0, step_ = 0;
  DeviceBuffer moments_;  // m then v, each `count` floats
};

class Sgd {
 public:
  Sgd() = default;
  // With momentum != 0, a momentum buffer of `count` floats (set on the first step).
  static Result<Sgd> Create(int64_t count, float lr, float momentum, float weight_decay);

  Status Step(float* params, const float* grads, cudaStream_t stream, WorkingCopy working = {});
  Status Step(std::span<const ParameterSlice> slices, cudaStream_t stream);
  // The next step starts the momentum afresh, as models::Sgd::Reset.
  void Reset() { first_ = true; }
  int64_t size() const { return count_; }

 private:
  Status StepSlices(std::span<const ParameterSlice> slices, WorkingCopy working, cudaStream_t stream);

  float lr_ = 0, momentum_ = 0, weight_decay_ = 0;
  int64_t count_ = 0;
  bool first_ = true;
  DeviceBuffer buffer_;
};

// models::ClipGradNorm on the device: grads *= min(1, max_norm / (norm + 1e-6))
// with norm the L2 norm of all `count` gradients (accumulated in double).
// *norm (a device double) receives the norm before clipping; the scratch
// (about 8 KiB) comes from `arena`.
Status ClipGradNorm(float* grads, int64_t count, double max_norm, double* norm, Arena& arena, cudaStream_t stream);

}  // namespace estuary::models::cuda
