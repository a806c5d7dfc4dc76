#include "models/optimizer.h"

#include <cassert>

namespace estuary::models {

void Sgd::Step(std::span<float> params, std::span<const float> grads) {
  assert(params.size() == grads.size());
  const size_t n = params.size();
  float* p = params.data();
  const float* g = grads.data();
  const float lr = lr_, wd = weight_decay_, mu = momentum_;
  if (mu == 0.0f) {
    for (size_t i = 0; i < n; ++i) p[i] -= lr * (g[i] + wd * p[i]);
    return;
  }
  if (momentum_buffer_.size() != n) {
    // torch: the first step initialises the buffer with the gradient itself.
    momentum_buffer_.resize(n);
    float* b = momentum_buffer_.data();
    for (size_t i = 0; i < n; ++i) {
      b[i] = g[i] + wd * p[i];
      p[i] -= lr * b[i];
    }
    return;
  }
  float* b = momentum_buffer_.data();
  for (size_t i = 0; i < n; ++i) {
    b[i] = mu * b[i] + (g[i] + wd * p[i]);
    p[i] -= lr * b[i];
  }
}

}  // namespace estuary::models
