// Optimizers over flat buffers, with PyTorch's semantics.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/status.h"

namespace estuary::models {

// A run of parameters and their gradients. An optimizer steps a list of them
// as one parameter set, as torch steps a list of tensors: one step count, its
// state laid out slice after slice. A ZeRO rank's pieces lie apart in the
// model's flat buffers (parallel/data_parallel.h), and are stepped where they lie.
struct ParameterSlice {
  float* params = nullptr;
  const float* grads = nullptr;
  size_t size = 0;
};

// The total size of slices.
size_t SliceElements(std::span<const ParameterSlice> slices);

// torch.optim.SGD: g += wd * p; buf = momentum * buf + g (buf = g on the first
// step); p -= lr * buf. With momentum == 0 no buffer is kept.
class Sgd {
 public:
  Sgd(float lr, float momentum, float weight_decay) : lr_(lr), momentum_(momentum), weight_decay_(weight_decay) {}
  void Step(std::span<float> params, std::span<const float> grads);
  void Step(std::span<const ParameterSlice> slices);
  void Reset() { momentum_buffer_.clear(); }

 private:
  float lr_, momentum_, weight_decay_;
  std::vector<float> momentum_buffer_;
};

// torch.optim.AdamW: p *= 1 - lr * wd (decoupled decay, before the moments);
// m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; with bias corrections
// c1 = 1 - b1^t, c2 = 1 - b2^t:  p -= (lr / c1) * m / (sqrt(v) / sqrt(c2) + eps).
// The moments live in two flat buffers of the parameters' layout, allocated
// on the first step; step_count() is t after the last step.
struct AdamWOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-2f;
};

class AdamW {
 public:
  explicit AdamW(AdamWOptions options) : options_(options) {}
  void Step(std::span<float> params, std::span<const float> grads);
  void Step(std::span<const ParameterSlice> slices);
  void set_lr(float lr) { options_.lr = lr; }
  const AdamWOptions& options() const { return options_; }
  int64_t step_count() const { return step_; }
  std::span<const float> first_moment() const { return m_; }
  std::span<const float> second_moment() const { return v_; }
  // Resumes from saved moments and step count (a checkpoint's), so the next
  // Step continues bit for bit as if training had not stopped.
  Status Restore(std::span<const float> first_moment, std::span<const float> second_moment, int64_t step_count);

 private:
  AdamWOptions options_;
  int64_t step_ = 0;
  std::vector<float> m_, v_;
};

// torch.nn.utils.clip_grad_norm_: scales grads by min(1, max_norm / (norm + 1e-6))
// where norm is the L2 norm of the whole flat gradient buffer (accumulated in
// double). Returns that norm, before clipping.
double ClipGradNorm(std::span<float> grads, double max_norm);

}  // namespace estuary::models
