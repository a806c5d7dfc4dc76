#include "models/optimizer.h"

#include <cassert>
#include <cmath>

namespace estuary::models {

size_t SliceElements(std::span<const ParameterSlice> slices) {
  size_t n = 0;
  for (const ParameterSlice& s : slices) n += s.size;
  return n;
}

void Sgd::Step(std::span<float> params, std::span<const float> grads) {
  assert(params.size() == grads.size());
  const ParameterSlice whole{params.data(), grads.data(), params.size()};
  Step(std::span<const ParameterSlice>(&whole, 1));
}

void Sgd::Step(std::span<const ParameterSlice> slices) {
  const float lr = lr_, wd = weight_decay_, mu = momentum_;
  if (mu == 0.0f) {
    for (const ParameterSlice& s : slices) {
      float* p = s.params;
      const float* g = s.grads;
      for (size_t i = 0; i < s.size; ++i) p[i] -= lr * (g[i] + wd * p[i]);
    }
    return;
  }
  const size_t n = SliceElements(slices);
  // torch: the first step initialises the buffer with the gradient itself.
  const bool first = momentum_buffer_.size() != n;
  if (first) momentum_buffer_.resize(n);
  float* b = momentum_buffer_.data();
  for (const ParameterSlice& s : slices) {
    float* p = s.params;
    const float* g = s.grads;
    if (first) {
      for (size_t i = 0; i < s.size; ++i) {
        b[i] = g[i] + wd * p[i];
        p[i] -= lr * b[i];
      }
    } else {
      for (size_t i = 0; i < s.size; ++i) {
        b[i] = mu * b[i] + (g[i] + wd * p[i]);
        p[i] -= lr * b[i];
      }
    }
    b += s.size;
  }
}

void AdamW::Step(std::span<float> params, std::span<const float> grads) {
  assert(params.size() == grads.size());
  const ParameterSlice whole{params.data(), grads.data(), params.size()};
  Step(std::span<const ParameterSlice>(&whole, 1));
}

void AdamW::Step(std::span<const ParameterSlice> slices) {
  const size_t n = SliceElements(slices);
  if (m_.size() != n) {
    m_.assign(n, 0.0f);
    v_.assign(n, 0.0f);
    step_ = 0;
  }
  ++step_;
  const auto& o = options_;
  // torch computes the corrections in double and the update in float.
  const double c1 = 1.0 - std::pow(static_cast<double>(o.beta1), static_cast<double>(step_));
  const double c2 = 1.0 - std::pow(static_cast<double>(o.beta2), static_cast<double>(step_));
  const float step_size = static_cast<float>(o.lr / c1);
  const float c2_sqrt = static_cast<float>(std::sqrt(c2));
  const float decay = 1.0f - o.lr * o.weight_decay;
  const float b1 = o.beta1, b2 = o.beta2, eps = o.eps;
  float* m = m_.data();
  float* v = v_.data();
  for (const ParameterSlice& s : slices) {
    float* p = s.params;
    const float* g = s.grads;
    for (size_t i = 0; i < s.size; ++i) {
      p[i] *= decay;
      m[i] = b1 * m[i] + (1.0f - b1) * g[i];
      v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
      p[i] -= step_size * m[i] / (std::sqrt(v[i]) / c2_sqrt + eps);
    }
    m += s.size;
    v += s.size;
  }
}

Status AdamW::Restore(std::span<const float> first_moment, std::span<const float> second_moment, int64_t step_count) {
  if (first_moment.size() != second_moment.size()) {
    return InvalidArgument("adamw: moments of {} and {} values differ in size", first_moment.size(),
                           second_moment.size());
  }
  if (step_count < 1) return InvalidArgument("adamw: step count {} must be >= 1 to restore", step_count);
  m_.assign(first_moment.begin(), first_moment.end());
  v_.assign(second_moment.begin(), second_moment.end());
  step_ = step_count;
  return Status::Ok();
}

double ClipGradNorm(std::span<float> grads, double max_norm) {
  double sum = 0;
  for (float g : grads) sum += static_cast<double>(g) * g;
  const double norm = std::sqrt(sum);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    const float scale = static_cast<float>(coef);
    for (float& g : grads) g *= scale;
  }
  return norm;
}

}  // namespace estuary::models
