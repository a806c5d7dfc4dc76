// What the GPU model suites (cuda_llama_test, cuda_lora_test,
// cuda_classifier_test) share: a Status assertion, Result unwrapping, the
// per-tensor error metric, and the two small decoders they test.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

#include "base/status.h"
#include "models/llama.h"

namespace estuary::models::cuda_test {

#define ASSERT_OK(expr)                              \
  do {                                               \
    const ::estuary::Status status_ = (expr);        \
    ASSERT_TRUE(status_.ok()) << status_.ToString(); \
  } while (0)

template <typename T>
T Unwrap(Result<T> r) {
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(*r) : T{};
}

// max |a - b| / max |b|; infinite when any difference is not finite.
inline double RelativeError(const float* a, const float* b, size_t n) {
  double diff = 0, scale = 1e-30;
  for (size_t i = 0; i < n; ++i) {
    const double d = std::abs(double(a[i]) - double(b[i]));
    if (!std::isfinite(d)) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, d);
    scale = std::max(scale, double(std::abs(b[i])));
  }
  return diff / scale;
}

// Grouped-query attention with an untied head.
inline LlamaConfig GqaUntied() {
  LlamaConfig c;
  c.vocab_size = 61;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.max_seq_len = 16;
  return c;
}

// Multi-head attention with tied embeddings.
inline LlamaConfig MhaTied() {
  LlamaConfig c;
  c.vocab_size = 53;
  c.hidden_size = 24;
  c.intermediate_size = 40;
  c.num_layers = 2;
  c.num_heads = 3;
  c.num_kv_heads = 3;
  c.max_seq_len = 12;
  c.tie_embeddings = true;
  return c;
}

}  // namespace estuary::models::cuda_test
