// Kernels over flat buffers: conversions, unscale + non-finite check, the
// fused optimizers, the global norm and ReLU. They are bandwidth bound, so each
// moves four elements per load/store when the caller promised alignment
// (`vec`), and loops over the buffer with a bounded grid.
#include "models/cuda/kernel_common.cuh"

namespace estuary::models::cuda::internal {
namespace {

struct NoOutput {};  // an optimizer step that writes no working copy

// N consecutive elements to and from fp32 registers; N == 4 is one 16-byte
// (fp32) or 8-byte (bf16/fp16) access, which needs the promised alignment.
template <int N>
__device__ inline void LoadN(const float* p, float (&v)[N]) {
  if constexpr (N == 4) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = p[j];
  }
}
template <int N>
__device__ inline void StoreN(float* p, const float (&v)[N]) {
  if constexpr (N == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) p[j] = v[j];
  }
}

template <typename T>
struct Pair;  // two 16-bit values, one 32-bit word
template <>
struct Pair<bf16> {
  using Type = __nv_bfloat162;
  static __device__ Type Make(float a, float b) { return __floats2bfloat162_rn(a, b); }
  static __device__ float2 Widen(Type p) { return __bfloat1622float2(p); }
};
template <>
struct Pair<f16> {
  using Type = __half2;
  static __device__ Type Make(float a, float b) { return __floats2half2_rn(a, b); }
  static __device__ float2 Widen(Type p) { return __half22float2(p); }
};
// Four 16-bit values move as one uint2 (a struct of two pairs would be split
// into two 4-byte accesses); memcpy is how CUDA C++ reinterprets the bits.
template <int N, typename T>
__device__ inline void LoadN(const T* p, float (&v)[N]) {
  if constexpr (N == 4) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    typename Pair<T>::Type lo_pair, hi_pair;
    memcpy(&lo_pair, &raw.x, 4);
    memcpy(&hi_pair, &raw.y, 4);
    const float2 lo = Pair<T>::Widen(lo_pair), hi = Pair<T>::Widen(hi_pair);
    v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = ToFloat<T>(p[j]);
  }
}
template <int N, typename T>
__device__ inline void StoreN(T* p, const float (&v)[N]) {
  if constexpr (N == 4) {
    const typename Pair<T>::Type lo = Pair<T>::Make(v[0], v[1]), hi = Pair<T>::Make(v[2], v[3]);
    uint2 raw;
    memcpy(&raw.x, &lo, 4);
    memcpy(&raw.y, &hi, 4);
    *reinterpret_cast<uint2*>(p) = raw;
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) p[j] = FromFloat<T>(v[j]);
  }
}
template <int N>
__device__ inline void StoreN(NoOutput*, const float (&)[N]) {}

// Runs op.Apply<4>(i) on aligned quads, then op.Apply<1>(i) on the tail (or
// everything when not vectorised). Each element is visited exactly once.
template <typename Op>
__global__ void __launch_bounds__(kThreads) FlatKernel(Op op, int64_t n, bool vec) {
  int64_t scalar_from = 0;
  if (vec) {
    const int64_t quads = n / 4;
    for (int64_t q = FirstIndex(); q < quads; q += Stride()) op.template Apply<4>(q * 4);
    scalar_from = quads * 4;
  }
  for (int64_t i = scalar_from + FirstIndex(); i < n; i += Stride()) op.template Apply<1>(i);
}

template <typename Op>
cudaError_t LaunchFlat(const Op& op, int64_t n, bool vec, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  FlatKernel<<<unsigned(Blocks(vec ? n / 4 + 1 : n)), kThreads, 0, s>>>(op, n, vec);
  return cudaGetLastError();
}

template <typename In, typename Out>
struct ConvertOp {
  const In* src;
  Out* dst;
  template <int N>
  __device__ void Apply(int64_t i) const {
    float v[N];
    LoadN<N>(src + i, v);
    StoreN<N>(dst + i, v);
  }
};

template <typename W>
struct AdamWOp {
  float *params, *exp_avg, *exp_avg_sq;
  const float* grads;
  W* working;
  AdamWArgs a;
  template <int N>
  __device__ void Apply(int64_t i) const {
    float p[N], g[N], m[N], v[N];
    LoadN<N>(params + i, p);
    LoadN<N>(grads + i, g);
    LoadN<N>(exp_avg + i, m);
    LoadN<N>(exp_avg_sq + i, v);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      // torch.optim.AdamW, in models::AdamW's order of operations: decoupled
      // decay first, eps added outside the square root.
      p[j] *= a.decay;
      m[j] = a.beta1 * m[j] + a.one_minus_beta1 * g[j];
      v[j] = a.beta2 * v[j] + a.one_minus_beta2 * g[j] * g[j];
      p[j] -= a.step_size * m[j] / (sqrtf(v[j]) / a.bias_correction2_sqrt + a.eps);
    }
    StoreN<N>(params + i, p);
    StoreN<N>(exp_avg + i, m);
    StoreN<N>(exp_avg_sq + i, v);
    StoreN<N>(working + (working ? i : 0), p);
  }
};

template <typename W>
struct SgdOp {
  float *params, *buffer;
  const float* grads;
  W* working;
  float lr, momentum, weight_decay;
  bool first;
  template <int N>
  __device__ void Apply(int64_t i) const {
    float p[N], g[N], b[N];
    LoadN<N>(params + i, p);
    LoadN<N>(grads + i, g);
    if (buffer && !first) LoadN<N>(buffer + i, b);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float d = g[j] + weight_decay * p[j];
      // torch.optim.SGD: the first step's buffer is the gradient itself.
      if (buffer) b[j] = first ? d : momentum * b[j] + d;
      p[j] -= lr * (buffer ? b[j] : d);
    }
    StoreN<N>(params + i, p);
    if (buffer) StoreN<N>(buffer + i, b);
    StoreN<N>(working + (working ? i : 0), p);
  }
};

struct ReluForwardOp {
  float* x;
  template <int N>
  __device__ void Apply(int64_t i) const {
    float v[N];
    LoadN<N>(x + i, v);
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = v[j] > 0.0f ? v[j] : 0.0f;  // NaN -> 0, as models::ReluForward
    StoreN<N>(x + i, v);
  }
};

struct ReluBackwardOp {
  const float* y;
  float* dy;
  template <int N>
  __device__ void Apply(int64_t i) const {
    float out[N], d[N];
    LoadN<N>(y + i, out);
    LoadN<N>(dy + i, d);
#pragma unroll
    for (int j = 0; j < N; ++j) d[j] = out[j] > 0.0f ? d[j] : 0.0f;
    StoreN<N>(dy + i, d);
  }
};

// The per-thread flag is written once at the end, so a buffer full of infs
// does not become a storm of stores to one address.
__global__ void __launch_bounds__(kThreads)
    UnscaleKernel(float* grads, int64_t n, float inv_scale, float* found_inf, bool vec) {
  bool bad = false;
  int64_t scalar_from = 0;
  if (vec) {
    const int64_t quads = n / 4;
    for (int64_t q = FirstIndex(); q < quads; q += Stride()) {
      float v[4];
      LoadN<4>(grads + q * 4, v);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        bad |= !isfinite(v[j]);
        v[j] *= inv_scale;
      }
      StoreN<4>(grads + q * 4, v);
    }
    scalar_from = quads * 4;
  }
  for (int64_t i = scalar_from + FirstIndex(); i < n; i += Stride()) {
    bad |= !isfinite(grads[i]);
    grads[i] *= inv_scale;
  }
  if (bad) *found_inf = 1.0f;
}

__global__ void __launch_bounds__(kThreads)
    ScaleKernel(float* grads, int64_t n, const float* coef, bool vec) {
  const float c = *coef;
  int64_t scalar_from = 0;
  if (vec) {
    const int64_t quads = n / 4;
    for (int64_t q = FirstIndex(); q < quads; q += Stride()) {
      float v[4];
      LoadN<4>(grads + q * 4, v);
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] *= c;
      StoreN<4>(grads + q * 4, v);
    }
    scalar_from = quads * 4;
  }
  for (int64_t i = scalar_from + FirstIndex(); i < n; i += Stride()) grads[i] *= c;
}

// Sum of a block's values by a fixed tree: the same order on every run.
template <int kBlock>
__device__ double BlockSum(double value, double* shared) {
  shared[threadIdx.x] = value;
  __syncthreads();
#pragma unroll
  for (int half = kBlock / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) shared[threadIdx.x] += shared[threadIdx.x + half];
    __syncthreads();
  }
  return shared[0];
}

// Squares are summed in double: a flat buffer of 10^9 gradients would lose
// digits in fp32 long before the 1e-5 the CPU comparison allows.
__global__ void __launch_bounds__(kThreads)
    SquaredNormKernel(const float* grads, int64_t n, double* partials, bool vec) {
  __shared__ double shared[kThreads];
  double sum = 0;
  int64_t scalar_from = 0;
  if (vec) {
    const int64_t quads = n / 4;
    for (int64_t q = FirstIndex(); q < quads; q += Stride()) {
      float v[4];
      LoadN<4>(grads + q * 4, v);
#pragma unroll
      for (int j = 0; j < 4; ++j) sum += double(v[j]) * v[j];
    }
    scalar_from = quads * 4;
  }
  for (int64_t i = scalar_from + FirstIndex(); i < n; i += Stride()) sum += double(grads[i]) * grads[i];
  const double block = BlockSum<kThreads>(sum, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = block;
}

__global__ void __launch_bounds__(kNormBlocks)
    ClipCoefficientKernel(const double* partials, double max_norm, double* norm, float* coef) {
  __shared__ double shared[kNormBlocks];
  const double total = BlockSum<kNormBlocks>(partials[threadIdx.x], shared);
  if (threadIdx.x == 0) {
    // As models::ClipGradNorm (and torch's clamp to 1): in double, rounded once.
    const double total_norm = sqrt(total);
    const double clip = max_norm / (total_norm + 1e-6);
    *norm = total_norm;
    *coef = clip < 1.0 ? float(clip) : 1.0f;
  }
}

__global__ void ProbeKernel() {}

}  // namespace

cudaError_t ProbeKernelImage() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, ProbeKernel);
}

cudaError_t Convert(const void* src, Kind src_kind, void* dst, Kind dst_kind, int64_t n, bool vec, cudaStream_t s) {
  const float* f = static_cast<const float*>(src);
  if (src_kind == Kind::kF32 && dst_kind == Kind::kBF16)
    return LaunchFlat(ConvertOp<float, bf16>{f, static_cast<bf16*>(dst)}, n, vec, s);
  if (src_kind == Kind::kF32 && dst_kind == Kind::kF16)
    return LaunchFlat(ConvertOp<float, f16>{f, static_cast<f16*>(dst)}, n, vec, s);
  if (src_kind == Kind::kBF16 && dst_kind == Kind::kF32)
    return LaunchFlat(ConvertOp<bf16, float>{static_cast<const bf16*>(src), static_cast<float*>(dst)}, n, vec, s);
  if (src_kind == Kind::kF16 && dst_kind == Kind::kF32)
    return LaunchFlat(ConvertOp<f16, float>{static_cast<const f16*>(src), static_cast<float*>(dst)}, n, vec, s);
  return cudaErrorInvalidValue;
}

cudaError_t UnscaleAndCheck(float* grads, int64_t n, float inv_scale, float* found_inf, bool vec, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  UnscaleKernel<<<unsigned(Blocks(vec ? n / 4 + 1 : n)), kThreads, 0, s>>>(grads, n, inv_scale, found_inf, vec);
  return cudaGetLastError();
}

cudaError_t AdamWStep(float* params, const float* grads, float* exp_avg, float* exp_avg_sq, int64_t n,
                      const AdamWArgs& args, void* working, Kind working_kind, bool vec, cudaStream_t s) {
  switch (working_kind) {
    case Kind::kNone:
      return LaunchFlat(AdamWOp<NoOutput>{params, exp_avg, exp_avg_sq, grads, nullptr, args}, n, vec, s);
    case Kind::kBF16:
      return LaunchFlat(AdamWOp<bf16>{params, exp_avg, exp_avg_sq, grads, static_cast<bf16*>(working), args}, n,
                        vec, s);
    case Kind::kF16:
      return LaunchFlat(AdamWOp<f16>{params, exp_avg, exp_avg_sq, grads, static_cast<f16*>(working), args}, n,
                        vec, s);
    case Kind::kF32: break;
  }
  return cudaErrorInvalidValue;
}

cudaError_t SgdStep(float* params, const float* grads, float* momentum_buffer, int64_t n, float lr, float momentum,
                    float weight_decay, bool first, void* working, Kind working_kind, bool vec, cudaStream_t s) {
  switch (working_kind) {
    case Kind::kNone:
      return LaunchFlat(SgdOp<NoOutput>{params, momentum_buffer, grads, nullptr, lr, momentum, weight_decay, first},
                        n, vec, s);
    case Kind::kBF16:
      return LaunchFlat(SgdOp<bf16>{params, momentum_buffer, grads, static_cast<bf16*>(working), lr, momentum,
                                    weight_decay, first},
                        n, vec, s);
    case Kind::kF16:
      return LaunchFlat(SgdOp<f16>{params, momentum_buffer, grads, static_cast<f16*>(working), lr, momentum,
                                   weight_decay, first},
                        n, vec, s);
    case Kind::kF32: break;
  }
  return cudaErrorInvalidValue;
}

cudaError_t SquaredNormPartials(const float* grads, int64_t n, double* partials, bool vec, cudaStream_t s) {
  // Always all kNormBlocks blocks, even for tiny n: every partial gets written.
  SquaredNormKernel<<<kNormBlocks, kThreads, 0, s>>>(grads, n, partials, vec);
  return cudaGetLastError();
}

cudaError_t ClipCoefficient(const double* partials, double max_norm, double* norm, float* coef, cudaStream_t s) {
  ClipCoefficientKernel<<<1, kNormBlocks, 0, s>>>(partials, max_norm, norm, coef);
  return cudaGetLastError();
}

cudaError_t ScaleByDeviceScalar(float* grads, int64_t n, const float* coef, bool vec, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  ScaleKernel<<<unsigned(Blocks(vec ? n / 4 + 1 : n)), kThreads, 0, s>>>(grads, n, coef, vec);
  return cudaGetLastError();
}

cudaError_t ReluForward(float* x, int64_t n, bool vec, cudaStream_t s) {
  return LaunchFlat(ReluForwardOp{x}, n, vec, s);
}

cudaError_t ReluBackward(const float* y, float* dy, int64_t n, bool vec, cudaStream_t s) {
  return LaunchFlat(ReluBackwardOp{y, dy}, n, vec, s);
}

}  // namespace estuary::models::cuda::internal
