// What the kernel files share on the device side (internal; included by the
// .cu files only, so nothing here may include base/status.h, see kernels.h):
// the size and indices of a grid-stride loop, each storage dtype's exact
// widening to and rounding from the fp32 every kernel computes in, loads and
// stores of N consecutive elements, and the C++ type behind a Kind.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "models/cuda/kernels.h"

namespace estuary::models::cuda::internal {

using bf16 = __nv_bfloat16;
using f16 = __half;

// Blocks of `threads` for a grid-stride loop over work_items: at least one,
// at most kMaxBlocks (bigger inputs loop).
inline int64_t Blocks(int64_t work_items, int threads = kThreads) {
  const int64_t blocks = (work_items + threads - 1) / threads;
  return blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks);
}

__device__ inline int64_t FirstIndex() { return int64_t(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ inline int64_t Stride() { return int64_t(gridDim.x) * blockDim.x; }

// A storage dtype to fp32 (exact) and back (rounded to nearest even).
template <typename T>
struct Fp32;
template <>
struct Fp32<float> {
  static __device__ float Widen(float v) { return v; }
  static __device__ float Round(float v) { return v; }
};
template <>
struct Fp32<bf16> {
  static __device__ float Widen(bf16 v) { return __bfloat162float(v); }
  static __device__ bf16 Round(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Fp32<f16> {
  static __device__ float Widen(f16 v) { return __half2float(v); }
  static __device__ f16 Round(float v) { return __float2half_rn(v); }
};
template <typename T>
__device__ inline float ToFloat(T v) { return Fp32<T>::Widen(v); }
template <typename T>
__device__ inline T FromFloat(float v) { return Fp32<T>::Round(v); }

// N consecutive elements to and from fp32. N == 4 is one 16-byte (fp32) or
// 8-byte (16-bit) access: the caller guarantees that alignment.
template <int N, typename T>
__device__ inline void Load(const T* p, float (&v)[N]) {
  if constexpr (N == 4 && sizeof(T) == 4) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else if constexpr (N == 4 && sizeof(T) == 2) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    T parts[4];
    memcpy(parts, &raw, 8);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = ToFloat<T>(parts[j]);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = ToFloat<T>(p[j]);
  }
}
template <int N, typename T>
__device__ inline void Store(T* p, const float (&v)[N]) {
  if constexpr (N == 4 && sizeof(T) == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else if constexpr (N == 4 && sizeof(T) == 2) {
    T parts[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) parts[j] = FromFloat<T>(v[j]);
    uint2 raw;
    memcpy(&raw, parts, 8);
    *reinterpret_cast<uint2*>(p) = raw;
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) p[j] = FromFloat<T>(v[j]);
  }
}

// Calls f with a value of the C++ type behind `kind`.
template <typename F>
cudaError_t Dispatch(Kind kind, F&& f) {
  switch (kind) {
    case Kind::kF32: return f(float{});
    case Kind::kBF16: return f(bf16{});
    case Kind::kF16: return f(f16{});
    case Kind::kNone: break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace estuary::models::cuda::internal
