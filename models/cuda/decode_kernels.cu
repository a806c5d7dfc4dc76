// The cached decoder's kernels (decode_kernels.h): appending a chunk's keys
// and values to the cache, and its queries' attention over the cache.
#include <cmath>

#include "models/cuda/decode_kernels.h"
#include "models/cuda/kernel_common.cuh"

namespace estuary::models::cuda::internal {
namespace {

constexpr int kWarp = 32;
constexpr int kDimsPerLane = kDecodeMaxHeadDim / kWarp;
// Warps per block of the attention kernel, each on its own (row, head).
constexpr int kAttentionWarps = 4;

template <typename T>
__global__ void __launch_bounds__(kThreads) AppendKvKernel(const T* qkv, int64_t total, int heads, int kv_heads,
                                                           int head_dim, int capacity, int past, T* keys, T* values) {
  const int64_t width = int64_t(heads + 2 * kv_heads) * head_dim;
  for (int64_t i = FirstIndex(); i < total; i += Stride()) {
    // i runs over [rows, kv_heads, head_dim].
    const int d = int(i % head_dim);
    const int64_t rest = i / head_dim;
    const int g = int(rest % kv_heads);
    const int64_t t = rest / kv_heads;
    const T* row = qkv + t * width;
    const int64_t at = (int64_t(g) * capacity + past + t) * head_dim + d;
    keys[at] = row[int64_t(heads + g) * head_dim + d];
    values[at] = row[int64_t(heads + kv_heads + g) * head_dim + d];
  }
}

// One warp per (query row t, head h); lane l holds dimensions l, l + 32, ...
// of the query and of the running output. Every lane computes the same score
// (a butterfly sum), so the running max and sum agree across the warp, and
// the loop bounds are uniform: the shuffles always have all 32 lanes.
template <typename T>
__global__ void __launch_bounds__(kAttentionWarps* kWarp)
    DecodeAttentionKernel(const T* qkv, const T* keys, const T* values, int rows, int heads, int kv_heads,
                          int head_dim, int capacity, int past, float scale, T* out) {
  const int warp = int(threadIdx.x) / kWarp, lane = int(threadIdx.x) % kWarp;
  const int64_t pair = int64_t(blockIdx.x) * kAttentionWarps + warp;
  if (pair >= int64_t(rows) * heads) return;  // the whole warp leaves together
  const int t = int(pair / heads), h = int(pair % heads), g = h / (heads / kv_heads);
  const int64_t width = int64_t(heads + 2 * kv_heads) * head_dim;
  const T* q = qkv + int64_t(t) * width + int64_t(h) * head_dim;
  const T* k = keys + int64_t(g) * capacity * head_dim;
  const T* v = values + int64_t(g) * capacity * head_dim;
  float qr[kDimsPerLane], acc[kDimsPerLane];
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) {
    const int d = lane + i * kWarp;
    qr[i] = d < head_dim ? ToFloat<T>(q[d]) : 0.0f;
    acc[i] = 0.0f;
  }
  float running_max = -INFINITY, sum = 0.0f;
  const int last = past + t;  // causal: the chunk's row t sees positions up to its own
  for (int j = 0; j <= last; ++j) {
    const T* kj = k + int64_t(j) * head_dim;
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) {
      const int d = lane + i * kWarp;
      if (d < head_dim) dot += qr[i] * ToFloat<T>(kj[d]);
    }
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    const float score = dot * scale;
    const float new_max = fmaxf(running_max, score);
    const float correction = expf(running_max - new_max);  // 0 on the first key (exp(-inf))
    const float p = expf(score - new_max);
    sum = sum * correction + p;
    const T* vj = v + int64_t(j) * head_dim;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) {
      const int d = lane + i * kWarp;
      if (d < head_dim) acc[i] = acc[i] * correction + p * ToFloat<T>(vj[d]);
    }
    running_max = new_max;
  }
  const float inv = 1.0f / sum;
  T* o = out + int64_t(t) * heads * head_dim + int64_t(h) * head_dim;
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) {
    const int d = lane + i * kWarp;
    if (d < head_dim) o[d] = FromFloat<T>(acc[i] * inv);
  }
}

}  // namespace

cudaError_t AppendKv(const void* qkv, Kind kind, int rows, int heads, int kv_heads, int head_dim, int capacity,
                     int past, void* keys, void* values, cudaStream_t s) {
  const int64_t total = int64_t(rows) * kv_heads * head_dim;
  if (total <= 0) return cudaSuccess;
  return Dispatch(kind, [&](auto tag) {
    using T = decltype(tag);
    AppendKvKernel<T><<<unsigned(Blocks(total)), kThreads, 0, s>>>(static_cast<const T*>(qkv), total, heads, kv_heads,
                                                                    head_dim, capacity, past, static_cast<T*>(keys),
                                                                    static_cast<T*>(values));
    return cudaGetLastError();
  });
}

cudaError_t DecodeAttention(const void* qkv, const void* keys, const void* values, Kind kind, int rows, int heads,
                            int kv_heads, int head_dim, int capacity, int past, float scale, void* out,
                            cudaStream_t s) {
  const int64_t pairs = int64_t(rows) * heads;
  if (pairs <= 0) return cudaSuccess;
  if (head_dim < 1 || head_dim > kDecodeMaxHeadDim || kv_heads < 1 || heads % kv_heads != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t blocks = (pairs + kAttentionWarps - 1) / kAttentionWarps;
  return Dispatch(kind, [&](auto tag) {
    using T = decltype(tag);
    DecodeAttentionKernel<T><<<unsigned(blocks), kAttentionWarps * kWarp, 0, s>>>(
        static_cast<const T*>(qkv), static_cast<const T*>(keys), static_cast<const T*>(values), rows, heads,
        kv_heads, head_dim, capacity, past, scale, static_cast<T*>(out));
    return cudaGetLastError();
  });
}

}  // namespace estuary::models::cuda::internal
