// Kernels of the decoder's ops (models/transformer_ops.h on the GPU). Each
// reproduces its CPU counterpart's formula in the same order of operations,
// computing in fp32 whatever dtype it loads and stores. Row-wise ops (norms,
// softmaxes) give one warp or one block a row and reduce down to one lane, so
// every thread uses the same bits; column sums go through fixed partials.
// Nothing uses atomics, so results repeat bit for bit on one device.
#include <cfloat>
#include <cmath>

#include "models/cuda/kernel_common.cuh"
#include "models/cuda/transformer_kernels.h"

namespace estuary::models::cuda::internal {
namespace {

// Warp reductions end in lane 0 and are broadcast from it, so all lanes hold
// the same bits (an xor butterfly would add in a different order per lane).
__device__ inline float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  return __shfl_sync(0xffffffffu, v, 0);
}
__device__ inline float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, offset));
  return __shfl_sync(0xffffffffu, v, 0);
}

// A block-wide sum or max; `shared` holds one float per warp. Every thread
// returns the same value, and `shared` is free again on return.
template <bool kMax>
__device__ float BlockReduce(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = kMax ? WarpMax(v) : WarpSum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < warps ? shared[lane] : (kMax ? -INFINITY : 0.0f);
    w = kMax ? WarpMax(w) : WarpSum(w);
    if (lane == 0) shared[0] = w;
  }
  __syncthreads();
  const float result = shared[0];
  __syncthreads();
  return result;
}

// ------------------------------------------------------------------ RMSNorm

template <typename T>
__global__ void __launch_bounds__(kThreads) RmsNormForwardKernel(const float* x, const float* weight, int n, int dim,
                                                                 float eps, T* y, float* rstd) {
  const int lane = threadIdx.x & 31;
  for (int64_t row = FirstIndex() / 32; row < n; row += Stride() / 32) {
    const float* xr = x + row * dim;
    float sum = 0.0f;
    for (int j = lane; j < dim; j += 32) sum += xr[j] * xr[j];
    sum = WarpSum(sum);
    const float r = 1.0f / sqrtf(sum / float(dim) + eps);
    if (lane == 0) rstd[row] = r;
    T* yr = y + row * dim;
    for (int j = lane; j < dim; j += 32) yr[j] = FromFloat<T>(weight[j] * (xr[j] * r));
  }
}

// With xhat = x * rstd and g = weight * dy: dx += rstd * (g - xhat * mean(g * xhat)).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    RmsNormBackwardRowsKernel(const float* x, const float* weight, const float* rstd, const float* dy, int n, int dim,
                              float* dx, T* dx_copy) {
  const int lane = threadIdx.x & 31;
  for (int64_t row = FirstIndex() / 32; row < n; row += Stride() / 32) {
    const float* xr = x + row * dim;
    const float* dyr = dy + row * dim;
    const float r = rstd[row];
    float dot = 0.0f;
    for (int j = lane; j < dim; j += 32) dot += (weight[j] * dyr[j]) * (xr[j] * r);
    const float mean = WarpSum(dot) / float(dim);
    float* dxr = dx + row * dim;
    for (int j = lane; j < dim; j += 32) {
      const float v = dxr[j] + r * (weight[j] * dyr[j] - xr[j] * r * mean);
      dxr[j] = v;
      if (dx_copy) dx_copy[row * dim + j] = FromFloat<T>(v);
    }
  }
}

// Block (32, 8): a strip of 32 columns over one chunk of kRmsRowsPerChunk rows.
__global__ void __launch_bounds__(256) RmsNormWeightPartialsKernel(const float* x, const float* rstd, const float* dy,
                                                                   int n, int dim, int chunks, float* partials) {
  __shared__ float shared[8][33];
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
  for (int chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) {
    const int64_t first = int64_t(chunk) * kRmsRowsPerChunk;
    const int64_t last = first + kRmsRowsPerChunk < n ? first + kRmsRowsPerChunk : n;
    float acc = 0.0f;
    if (col < dim) {
      for (int64_t row = first + threadIdx.y; row < last; row += 8) {
        acc += dy[row * dim + col] * (x[row * dim + col] * rstd[row]);
      }
    }
    shared[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && col < dim) {
      float total = 0.0f;
#pragma unroll
      for (int k = 0; k < 8; ++k) total += shared[k][threadIdx.x];
      partials[int64_t(chunk) * dim + col] = total;
    }
    __syncthreads();
  }
}

__global__ void RmsNormWeightSumKernel(const float* partials, int chunks, int dim, float* dweight) {
  for (int64_t col = FirstIndex(); col < dim; col += Stride()) {
    float total = 0.0f;
    for (int c = 0; c < chunks; ++c) total += partials[int64_t(c) * dim + col];
    dweight[col] = total;
  }
}

// --------------------------------------------------------------------- RoPE

// In double, as the CPU: the angles' rounding would otherwise grow with pos.
__global__ void RopeTablesKernel(int max_seq, int head_dim, double theta, float* cos_table, float* sin_table) {
  const int half = head_dim / 2;
  for (int64_t i = FirstIndex(); i < int64_t(max_seq) * half; i += Stride()) {
    const int64_t pos = i / half;
    const int j = int(i - pos * half);
    const double inv_freq = 1.0 / pow(theta, double(2 * j) / head_dim);
    cos_table[i] = float(cos(double(pos) * inv_freq));
    sin_table[i] = float(sin(double(pos) * inv_freq));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) RopeKernel(T* x, int64_t total, int seq, int heads, int half,
                                                       int64_t row_stride, const float* cos_table,
                                                       const float* sin_table, float sign) {
  for (int64_t i = FirstIndex(); i < total; i += Stride()) {
    const int64_t pair = i / half, row = pair / heads;
    const int j = int(i - pair * half), h = int(pair - row * heads);
    const int64_t t = row % seq;
    T* lo = x + row * row_stride + int64_t(h) * 2 * half + j;
    T* hi = lo + half;
    const float a = ToFloat<T>(*lo), b = ToFloat<T>(*hi);
    const float c = cos_table[t * half + j], s = sign * sin_table[t * half + j];
    *lo = FromFloat<T>(a * c - b * s);
    *hi = FromFloat<T>(b * c + a * s);
  }
}

// ------------------------------------------------------------------- SwiGLU

template <typename T, int N>
__global__ void __launch_bounds__(kThreads) SwiGluForwardKernel(const T* gate_up, int64_t total, int hidden, T* out) {
  for (int64_t q = FirstIndex(); q < total / N; q += Stride()) {
    const int64_t i = q * N, row = i / hidden, j = i - row * hidden;
    const T* g = gate_up + row * 2 * hidden + j;
    float gv[N], uv[N], o[N];
    Load<N>(g, gv);
    Load<N>(g + hidden, uv);
#pragma unroll
    for (int k = 0; k < N; ++k) o[k] = gv[k] / (1.0f + expf(-gv[k])) * uv[k];
    Store<N>(out + i, o);
  }
}

// silu'(g) = s * (1 + g * (1 - s)) with s = sigmoid(g).
template <typename T, int N>
__global__ void __launch_bounds__(kThreads) SwiGluBackwardKernel(const T* gate_up, const T* dout, int64_t total,
                                                                 int hidden, T* dgate_up) {
  for (int64_t q = FirstIndex(); q < total / N; q += Stride()) {
    const int64_t i = q * N, row = i / hidden, j = i - row * hidden;
    const int64_t at = row * 2 * hidden + j;
    float gv[N], uv[N], d[N], dg[N], du[N];
    Load<N>(gate_up + at, gv);
    Load<N>(gate_up + at + hidden, uv);
    Load<N>(dout + i, d);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float s = 1.0f / (1.0f + expf(-gv[k]));
      du[k] = d[k] * gv[k] * s;
      dg[k] = d[k] * uv[k] * s * (1.0f + gv[k] * (1.0f - s));
    }
    Store<N>(dgate_up + at, dg);
    Store<N>(dgate_up + at + hidden, du);
  }
}

template <int N>
__global__ void __launch_bounds__(kThreads) ResidualAddKernel(const float* x, int64_t count, float* y) {
  for (int64_t q = FirstIndex(); q < count / N; q += Stride()) {
    float a[N], b[N];
    Load<N>(x + q * N, a);
    Load<N>(y + q * N, b);
#pragma unroll
    for (int k = 0; k < N; ++k) b[k] += a[k];
    Store<N>(y + q * N, b);
  }
}

// ---------------------------------------------------------------- attention

template <typename T>
__global__ void __launch_bounds__(kThreads) CausalSoftmaxKernel(const float* scores, int64_t rows, int seq,
                                                                T* probs) {
  const int lane = threadIdx.x & 31;
  for (int64_t row = FirstIndex() / 32; row < rows; row += Stride() / 32) {
    const int i = int(row % seq);  // the query position: keys 0..i are visible
    const float* s = scores + row * seq;
    T* p = probs + row * seq;
    float max = -INFINITY;
    for (int j = lane; j <= i; j += 32) max = fmaxf(max, s[j]);
    max = WarpMax(max);
    float sum = 0.0f;
    for (int j = lane; j <= i; j += 32) sum += expf(s[j] - max);
    const float inv = 1.0f / WarpSum(sum);
    // In place (p == s) is safe: each element is read and written by one lane,
    // after the warp-wide reductions above.
    for (int j = lane; j < seq; j += 32) p[j] = FromFloat<T>(j <= i ? expf(s[j] - max) * inv : 0.0f);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) CausalSoftmaxBackwardKernel(const T* probs, const float* dprobs,
                                                                        int64_t rows, int seq, float scale,
                                                                        T* dscores) {
  const int lane = threadIdx.x & 31;
  for (int64_t row = FirstIndex() / 32; row < rows; row += Stride() / 32) {
    const int i = int(row % seq);
    const T* p = probs + row * seq;
    const float* dp = dprobs + row * seq;
    T* ds = dscores + row * seq;
    float dot = 0.0f;
    for (int j = lane; j <= i; j += 32) dot += ToFloat<T>(p[j]) * dp[j];
    dot = WarpSum(dot);
    for (int j = lane; j < seq; j += 32) {
      ds[j] = FromFloat<T>(j <= i ? scale * ToFloat<T>(p[j]) * (dp[j] - dot) : 0.0f);
    }
  }
}

// ------------------------------------------------------------ cross-entropy

constexpr int kCrossEntropyThreads = 512;
constexpr int kMeanThreads = 1024;

// CUDA code cannot see transformer_ops.h's constant; the value is PyTorch's
// ignore_index, as there.
constexpr int32_t kIgnoredTarget = -100;

// *scored = the number of targets that are not kIgnoredTarget: the divisor
// of the mean, as the CPU's CrossEntropyForwardBackward counts it.
__global__ void __launch_bounds__(kMeanThreads) CountScoredKernel(const int32_t* targets, int n, int* scored) {
  __shared__ int shared[kMeanThreads];
  int count = 0;
  for (int i = threadIdx.x; i < n; i += kMeanThreads) count += targets[i] != kIgnoredTarget;
  shared[threadIdx.x] = count;
  __syncthreads();
  for (int half = kMeanThreads / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) shared[threadIdx.x] += shared[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) *scored = shared[0];
}

template <typename T>
__global__ void __launch_bounds__(kCrossEntropyThreads)
    CrossEntropyRowsKernel(const float* logits, const int32_t* targets, int n, int vocab, T* dlogits,
                           float grad_scale, const int* scored_count, float* row_loss) {
  __shared__ float shared[kCrossEntropyThreads / 32];
  const int scored = *scored_count;
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const float* z = logits + row * vocab;
    T* d = dlogits + row * vocab;
    const int target = targets[row];
    if (target == kIgnoredTarget) {  // scores nothing: no loss, no gradient
      for (int c = threadIdx.x; c < vocab; c += blockDim.x) d[c] = FromFloat<T>(0.0f);
      if (threadIdx.x == 0) row_loss[row] = 0.0f;
      continue;
    }
    const bool valid = target >= 0 && target < vocab;
    // Read before the block reductions below, whose barriers order it before
    // any write: dlogits may be the logits themselves.
    const float target_logit = valid ? z[target] : 0.0f;
    float max = -INFINITY;
    for (int c = threadIdx.x; c < vocab; c += blockDim.x) max = fmaxf(max, z[c]);
    max = BlockReduce<true>(max, shared);
    float sum = 0.0f;
    for (int c = threadIdx.x; c < vocab; c += blockDim.x) sum += expf(z[c] - max);
    sum = BlockReduce<false>(sum, shared);
    const float factor = float(double(grad_scale) / (double(sum) * scored));
    const float target_term = grad_scale / float(scored);
    for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
      float v = expf(z[c] - max) * factor;
      if (c == target) v -= target_term;
      d[c] = FromFloat<T>(valid ? v : NAN);
    }
    if (threadIdx.x == 0) row_loss[row] = valid ? logf(sum) - (target_logit - max) : NAN;
  }
}

// *mean = the sum of n values over *count (0 when nothing was scored, as on
// the CPU: a batch of prompts alone must not poison the weights).
__global__ void __launch_bounds__(kMeanThreads) MeanKernel(const float* values, int n, const int* count, float* mean) {
  __shared__ double shared[kMeanThreads];
  double sum = 0;
  for (int i = threadIdx.x; i < n; i += kMeanThreads) sum += values[i];
  shared[threadIdx.x] = sum;
  __syncthreads();
  for (int half = kMeanThreads / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) shared[threadIdx.x] += shared[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) *mean = *count > 0 ? float(shared[0] / *count) : 0.0f;
}

}  // namespace

// ------------------------------------------------------------------ launchers

cudaError_t RmsNormForward(const float* x, const float* weight, int n, int dim, float eps, void* y, Kind y_kind,
                           float* rstd, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  return Dispatch(y_kind, [&](auto tag) {
    using T = decltype(tag);
    RmsNormForwardKernel<T><<<unsigned(Blocks(int64_t(n) * 32)), kThreads, 0, s>>>(x, weight, n, dim, eps,
                                                                                   static_cast<T*>(y), rstd);
    return cudaGetLastError();
  });
}

cudaError_t RmsNormBackward(const float* x, const float* weight, const float* rstd, const float* dy, int n, int dim,
                            float* dx, float* dweight, float* partials, void* dx_copy, Kind copy_kind,
                            cudaStream_t s) {
  if (dim <= 0) return cudaSuccess;
  if (n > 0) {
    const cudaError_t rows = Dispatch(copy_kind == Kind::kNone ? Kind::kF32 : copy_kind, [&](auto tag) {
      using T = decltype(tag);
      T* copy = copy_kind == Kind::kNone ? nullptr : static_cast<T*>(dx_copy);
      RmsNormBackwardRowsKernel<T><<<unsigned(Blocks(int64_t(n) * 32)), kThreads, 0, s>>>(x, weight, rstd, dy, n,
                                                                                          dim, dx, copy);
      return cudaGetLastError();
    });
    if (rows != cudaSuccess) return rows;
  }
  const int chunks = int((int64_t(n) + kRmsRowsPerChunk - 1) / kRmsRowsPerChunk);
  if (chunks > 0) {
    const dim3 grid(unsigned((int64_t(dim) + 31) / 32), unsigned(chunks < 65535 ? chunks : 65535));
    RmsNormWeightPartialsKernel<<<grid, dim3(32, 8), 0, s>>>(x, rstd, dy, n, dim, chunks, partials);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  RmsNormWeightSumKernel<<<unsigned(Blocks(dim)), kThreads, 0, s>>>(partials, chunks, dim, dweight);
  return cudaGetLastError();
}

cudaError_t RopeTables(int max_seq, int head_dim, double theta, float* cos, float* sin, cudaStream_t s) {
  const int64_t total = int64_t(max_seq) * (head_dim / 2);
  if (total <= 0) return cudaSuccess;
  RopeTablesKernel<<<unsigned(Blocks(total)), kThreads, 0, s>>>(max_seq, head_dim, theta, cos, sin);
  return cudaGetLastError();
}

cudaError_t Rope(void* x, Kind kind, int batch, int seq, int heads, int head_dim, int64_t row_stride,
                 const float* cos, const float* sin, float sign, cudaStream_t s) {
  const int half = head_dim / 2;
  const int64_t total = int64_t(batch) * seq * heads * half;
  if (total <= 0) return cudaSuccess;
  return Dispatch(kind, [&](auto tag) {
    using T = decltype(tag);
    RopeKernel<T><<<unsigned(Blocks(total)), kThreads, 0, s>>>(static_cast<T*>(x), total, seq, heads, half,
                                                                row_stride, cos, sin, sign);
    return cudaGetLastError();
  });
}

cudaError_t SwiGluForward(const void* gate_up, int n, int hidden, void* out, Kind kind, bool vec, cudaStream_t s) {
  const int64_t total = int64_t(n) * hidden;
  if (total <= 0) return cudaSuccess;
  return Dispatch(kind, [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(gate_up);
    T* o = static_cast<T*>(out);
    if (vec) {
      SwiGluForwardKernel<T, 4><<<unsigned(Blocks(total / 4)), kThreads, 0, s>>>(in, total, hidden, o);
    } else {
      SwiGluForwardKernel<T, 1><<<unsigned(Blocks(total)), kThreads, 0, s>>>(in, total, hidden, o);
    }
    return cudaGetLastError();
  });
}

cudaError_t SwiGluBackward(const void* gate_up, const void* dout, int n, int hidden, void* dgate_up, Kind kind,
                           bool vec, cudaStream_t s) {
  const int64_t total = int64_t(n) * hidden;
  if (total <= 0) return cudaSuccess;
  return Dispatch(kind, [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(gate_up);
    const T* d = static_cast<const T*>(dout);
    T* o = static_cast<T*>(dgate_up);
    if (vec) {
      SwiGluBackwardKernel<T, 4><<<unsigned(Blocks(total / 4)), kThreads, 0, s>>>(in, d, total, hidden, o);
    } else {
      SwiGluBackwardKernel<T, 1><<<unsigned(Blocks(total)), kThreads, 0, s>>>(in, d, total, hidden, o);
    }
    return cudaGetLastError();
  });
}

cudaError_t ResidualAdd(const float* x, int64_t count, float* y, bool vec, cudaStream_t s) {
  if (count <= 0) return cudaSuccess;
  if (vec && count / 4 > 0) {
    ResidualAddKernel<4><<<unsigned(Blocks(count / 4)), kThreads, 0, s>>>(x, count, y);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    const int64_t done = count / 4 * 4;
    if (done == count) return cudaSuccess;
    // The last count % 4 elements.
    ResidualAddKernel<1><<<1, kThreads, 0, s>>>(x + done, count - done, y + done);
  } else {
    ResidualAddKernel<1><<<unsigned(Blocks(count)), kThreads, 0, s>>>(x, count, y);
  }
  return cudaGetLastError();
}

cudaError_t CausalSoftmax(const float* scores, int64_t rows, int seq, void* probs, Kind probs_kind, cudaStream_t s) {
  if (rows <= 0 || seq <= 0) return cudaSuccess;
  return Dispatch(probs_kind, [&](auto tag) {
    using T = decltype(tag);
    CausalSoftmaxKernel<T><<<unsigned(Blocks(rows * 32)), kThreads, 0, s>>>(scores, rows, seq, static_cast<T*>(probs));
    return cudaGetLastError();
  });
}

cudaError_t CausalSoftmaxBackward(const void* probs, Kind probs_kind, const float* dprobs, int64_t rows, int seq,
                                  float scale, void* dscores, Kind ds_kind, cudaStream_t s) {
  if (rows <= 0 || seq <= 0) return cudaSuccess;
  if (probs_kind != ds_kind) return cudaErrorInvalidValue;
  return Dispatch(probs_kind, [&](auto tag) {
    using T = decltype(tag);
    CausalSoftmaxBackwardKernel<T><<<unsigned(Blocks(rows * 32)), kThreads, 0, s>>>(
        static_cast<const T*>(probs), dprobs, rows, seq, scale, static_cast<T*>(dscores));
    return cudaGetLastError();
  });
}

cudaError_t CrossEntropy(const float* logits, const int32_t* targets, int n, int vocab, void* dlogits,
                         Kind dlogits_kind, float grad_scale, float* row_loss, int* scored, float* loss,
                         cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  CountScoredKernel<<<1, kMeanThreads, 0, s>>>(targets, n, scored);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const cudaError_t rows = Dispatch(dlogits_kind, [&](auto tag) {
    using T = decltype(tag);
    const int64_t blocks = n < kMaxBlocks ? n : kMaxBlocks;
    CrossEntropyRowsKernel<T><<<unsigned(blocks), kCrossEntropyThreads, 0, s>>>(
        logits, targets, n, vocab, static_cast<T*>(dlogits), grad_scale, scored, row_loss);
    return cudaGetLastError();
  });
  if (rows != cudaSuccess) return rows;
  MeanKernel<<<1, kMeanThreads, 0, s>>>(row_loss, n, scored, loss);
  return cudaGetLastError();
}

}  // namespace estuary::models::cuda::internal
