// The kernels of flash_attention.h; flash_attention.cc checks the arguments.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "models/cuda/kernel_common.cuh"

namespace estuary::models::cuda {

namespace {

using namespace nvcuda;

constexpr int kHeadDim = 64;  // the one head size compiled
constexpr int kTile = 64;     // query rows and key rows per tile
constexpr int kWarps = 4;     // each warp owns 16 rows of a tile
constexpr int kThreads = kWarps * 32;
constexpr int kFrag = 16;     // WMMA's m = n = k
// The row loops give each lane columns `lane` and `lane + 32` of a 64-wide
// row, for the score tiles and the output tiles alike.
static_assert(kTile == kHeadDim && kTile == 64, "the row loops assume 64-wide tiles");
// Row strides of the shared tiles, padded so that a warp's accesses down a
// column (WMMA's loads and stores) spread over the banks: 16-bit tiles 72
// elements (144 bytes), fp32 tiles 68 (272 bytes). Both keep every fragment's
// first element 32-byte aligned and the strides multiples of 8 and 4, as WMMA
// requires, and a 16-bit row 16-byte aligned for vector copies.
constexpr int kLd = 72;
constexpr int kLdF = 68;
constexpr int kTileElems = kTile * kLd;    // one 16-bit tile
constexpr int kTileFloats = kTile * kLdF;  // one fp32 tile

using internal::FromFloat;
using internal::ToFloat;

// Copies rows [row0, row0 + kTile) of one head (kHeadDim columns at `column`)
// of a [n, width] matrix into a padded tile, 16 bytes at a time (width and
// column are multiples of 8 elements); rows past seq become zero.
template <typename T>
__device__ void LoadTile(const T* base, int64_t width, int64_t column, int row0, int seq, T* tile) {
  constexpr int kVectors = kHeadDim * sizeof(T) / 16;  // per row
  for (int i = threadIdx.x; i < kTile * kVectors; i += kThreads) {
    const int r = i / kVectors, v = i % kVectors;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (row0 + r < seq) value = *reinterpret_cast<const uint4*>(base + int64_t(row0 + r) * width + column + v * 8);
    *reinterpret_cast<uint4*>(tile + r * kLd + v * 8) = value;
  }
}

// C[16 x 64] (fp32, row-major, ldc) = or += A[16 x 64] · B[64 x 64], one warp.
// A is row-major with lda; B is row-major (kBRowMajor) or its transpose
// stored row-major (B[k][n] = stored[n][k]), ldb either way.
template <typename T, bool kBRowMajor, bool kAccumulate>
__device__ void WarpGemm16x64(const T* a, int lda, const T* b, int ldb, float* c, int ldc) {
  using BLayout = std::conditional_t<kBRowMajor, wmma::row_major, wmma::col_major>;
#pragma unroll
  for (int nt = 0; nt < kTile / kFrag; ++nt) {
    wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float> acc;
    if constexpr (kAccumulate) {
      wmma::load_matrix_sync(acc, c + nt * kFrag, ldc, wmma::mem_row_major);
    } else {
      wmma::fill_fragment(acc, 0.0f);
    }
#pragma unroll
    for (int kt = 0; kt < kHeadDim / kFrag; ++kt) {
      wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, T, wmma::row_major> fa;
      wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, T, BLayout> fb;
      wmma::load_matrix_sync(fa, a + kt * kFrag, lda);
      if constexpr (kBRowMajor) {
        wmma::load_matrix_sync(fb, b + kt * kFrag * ldb + nt * kFrag, ldb);
      } else {
        wmma::load_matrix_sync(fb, b + nt * kFrag * ldb + kt * kFrag, ldb);
      }
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(c + nt * kFrag, acc, ldc, wmma::mem_row_major);
  }
}

// C[16 x 64] += Aᵀ[16 x 64] · B[64 x 64] where A is stored row-major [64 x
// 16-column slice]: the rows of C are columns of the stored A (dV += Pᵀ dO).
template <typename T>
__device__ void WarpGemmTransA16x64(const T* a, int lda, const T* b, int ldb, float* c, int ldc) {
#pragma unroll
  for (int nt = 0; nt < kTile / kFrag; ++nt) {
    wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float> acc;
    wmma::load_matrix_sync(acc, c + nt * kFrag, ldc, wmma::mem_row_major);
#pragma unroll
    for (int kt = 0; kt < kTile / kFrag; ++kt) {
      wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, T, wmma::col_major> fa;
      wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, T, wmma::row_major> fb;
      wmma::load_matrix_sync(fa, a + kt * kFrag * lda, lda);
      wmma::load_matrix_sync(fb, b + kt * kFrag * ldb + nt * kFrag, ldb);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(c + nt * kFrag, acc, ldc, wmma::mem_row_major);
  }
}

__device__ inline float WarpMax(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}
__device__ inline float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

struct Shape {
  int seq, heads, kv_heads;
  int64_t width, out_width;  // elements per row of qkv and of out
  float scale;               // 1 / sqrt(head_dim)
};

// Key rows [k0, k0 + kTile) of kv head g: its K and V tiles.
template <typename T>
__device__ void LoadKeyValueTiles(const T* base, const Shape& s, int g, int k0, T* k, T* v) {
  LoadTile(base, s.width, int64_t(s.heads + g) * kHeadDim, k0, s.seq, k);
  LoadTile(base, s.width, int64_t(s.heads + s.kv_heads + g) * kHeadDim, k0, s.seq, v);
}

// ---------------------------------------------------------------- forward

constexpr size_t kForwardSmem = (3 * kTileElems + kTileElems /* Q, K, V, P */) * 2 +
                                2 * kTileFloats * 4 /* S, O */ + 2 * kTile * 4 /* m, l */;

template <typename T>
__global__ void __launch_bounds__(kThreads) FlashForwardKernel(const T* qkv, Shape s, T* out, float* lse) {
  extern __shared__ __align__(128) unsigned char smem[];
  T* q = reinterpret_cast<T*>(smem);
  T* k = q + kTileElems;
  T* v = k + kTileElems;
  T* p = v + kTileElems;
  float* scores = reinterpret_cast<float*>(p + kTileElems);
  float* o = scores + kTileFloats;
  float* row_max = o + kTileFloats;
  float* row_sum = row_max + kTile;

  const int q0 = blockIdx.x * kTile;
  const int b = blockIdx.y / s.heads, h = blockIdx.y % s.heads, g = h / (s.heads / s.kv_heads);
  const T* base = qkv + int64_t(b) * s.seq * s.width;
  LoadTile(base, s.width, int64_t(h) * kHeadDim, q0, s.seq, q);
  for (int i = threadIdx.x; i < kTileFloats; i += kThreads) o[i] = 0.0f;
  for (int i = threadIdx.x; i < kTile; i += kThreads) row_max[i] = -INFINITY, row_sum[i] = 0.0f;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tiles = min((s.seq + kTile - 1) / kTile, int(blockIdx.x) + 1);  // up to the diagonal
  for (int t = 0; t < tiles; ++t) {
    const int k0 = t * kTile;
    __syncthreads();  // the previous tile's K and V are no longer read
    LoadKeyValueTiles(base, s, g, k0, k, v);
    __syncthreads();
    WarpGemm16x64<T, false, false>(q + warp * kFrag * kLd, kLd, k, kLd, scores + warp * kFrag * kLdF, kLdF);
    __syncwarp();
    // Online softmax, row by row over the warp's 16 rows, two columns a lane.
    for (int r = warp * kFrag; r < (warp + 1) * kFrag; ++r) {
      const int qi = q0 + r;
      float* srow = scores + r * kLdF;
      float x[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c = lane + 32 * j, kj = k0 + c;
        x[j] = kj <= qi && kj < s.seq ? srow[c] * s.scale : -INFINITY;
      }
      const float old_max = row_max[r];
      const float new_max = fmaxf(old_max, WarpMax(fmaxf(x[0], x[1])));
      // A row with nothing unmasked yet (padding past seq) keeps its zeros.
      const float alpha = new_max == -INFINITY ? 1.0f : __expf(old_max - new_max);
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c = lane + 32 * j;
        const float e = x[j] == -INFINITY ? 0.0f : __expf(x[j] - new_max);
        p[r * kLd + c] = FromFloat<T>(e);
        sum += e;
        o[r * kLdF + c] *= alpha;
      }
      sum = WarpSum(sum);
      if (lane == 0) {
        row_sum[r] = row_sum[r] * alpha + sum;
        row_max[r] = new_max;
      }
    }
    __syncwarp();
    WarpGemm16x64<T, true, true>(p + warp * kFrag * kLd, kLd, v, kLd, o + warp * kFrag * kLdF, kLdF);
    __syncwarp();
  }
  for (int r = warp * kFrag; r < (warp + 1) * kFrag; ++r) {
    const int qi = q0 + r;
    if (qi >= s.seq) break;
    const float inv = 1.0f / row_sum[r];
    T* dst = out + (int64_t(b) * s.seq + qi) * s.out_width + int64_t(h) * kHeadDim;
    dst[lane] = FromFloat<T>(o[r * kLdF + lane] * inv);
    dst[lane + 32] = FromFloat<T>(o[r * kLdF + lane + 32] * inv);
    if (lane == 0) lse[(int64_t(b) * s.heads + h) * s.seq + qi] = row_max[r] + logf(row_sum[r]);
  }
}

// ---------------------------------------------------------------- backward

// delta[b, h, i] = Σ_c dout[i, c] out[i, c]: one warp per row.
template <typename T>
__global__ void DeltaKernel(const T* out, const T* dout, Shape s, int rows, float* delta) {
  const int lane = threadIdx.x % 32;
  for (int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < rows;
       r += int64_t(gridDim.x) * blockDim.x / 32) {
    const int h = int(r % s.heads);
    const int64_t token = r / s.heads;  // b * seq + i
    const T* o = out + token * s.out_width + int64_t(h) * kHeadDim;
    const T* d = dout + token * s.out_width + int64_t(h) * kHeadDim;
    const float sum = WarpSum(ToFloat(o[lane]) * ToFloat(d[lane]) + ToFloat(o[lane + 32]) * ToFloat(d[lane + 32]));
    if (lane == 0) {
      const int64_t b = token / s.seq, i = token % s.seq;
      delta[(b * s.heads + h) * s.seq + i] = sum;
    }
  }
}

// A query tile's rows of the forward's log-sum-exp and of delta (0 past seq).
__device__ void LoadRowStats(const float* lse_h, const float* delta_h, int q0, int seq, float* lse_rows,
                             float* delta_rows) {
  for (int i = threadIdx.x; i < kTile; i += kThreads) {
    lse_rows[i] = q0 + i < seq ? lse_h[q0 + i] : 0.0f;
    delta_rows[i] = q0 + i < seq ? delta_h[q0 + i] : 0.0f;
  }
}

// For one warp's 16 rows of a (query tile, key tile) pair: S = Q Kᵀ into
// `scores` and dP = dO Vᵀ into `dprobs`, then P (the low-precision copy into
// p, when given) and dS = P (dP - delta) into ds, two columns a lane.
template <typename T>
__device__ void ProbsAndScoreGradients(const Shape& s, int q0, int k0, const T* q, const T* d_o, const T* k,
                                       const T* v, const float* lse_rows, const float* delta_rows, float* scores,
                                       float* dprobs, T* p, T* ds) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  WarpGemm16x64<T, false, false>(q + warp * kFrag * kLd, kLd, k, kLd, scores + warp * kFrag * kLdF, kLdF);
  WarpGemm16x64<T, false, false>(d_o + warp * kFrag * kLd, kLd, v, kLd, dprobs + warp * kFrag * kLdF, kLdF);
  __syncwarp();
  for (int r = warp * kFrag; r < (warp + 1) * kFrag; ++r) {
    const int qi = q0 + r;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = lane + 32 * j, kj = k0 + c;
      const bool live = qi < s.seq && kj < s.seq && kj <= qi;
      const float prob = live ? __expf(scores[r * kLdF + c] * s.scale - lse_rows[r]) : 0.0f;
      const float grad = prob * (dprobs[r * kLdF + c] - delta_rows[r]);
      if (p) p[r * kLd + c] = FromFloat<T>(prob);
      ds[r * kLd + c] = FromFloat<T>(grad);
    }
  }
}

constexpr size_t kDkvSmem = 6 * kTileElems * 2 /* K, V, Q, dO, P, dS */ + 4 * kTileFloats * 4 /* dK, dV, S, dP */ +
                            2 * kTile * 4 /* lse, delta */;

// One key tile of one kv head: dK and dV summed over the head's query heads
// (ascending) and the query tiles from the diagonal down.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    FlashBackwardKvKernel(const T* qkv, const T* dout, const float* lse, const float* delta, Shape s, T* dqkv) {
  extern __shared__ __align__(128) unsigned char smem[];
  T* k = reinterpret_cast<T*>(smem);
  T* v = k + kTileElems;
  T* q = v + kTileElems;
  T* d_o = q + kTileElems;
  T* p = d_o + kTileElems;
  T* ds = p + kTileElems;
  float* dk = reinterpret_cast<float*>(ds + kTileElems);
  float* dv = dk + kTileFloats;
  float* scores = dv + kTileFloats;
  float* dprobs = scores + kTileFloats;
  float* lse_rows = dprobs + kTileFloats;
  float* delta_rows = lse_rows + kTile;

  const int k0 = blockIdx.x * kTile;
  const int b = blockIdx.y / s.kv_heads, g = blockIdx.y % s.kv_heads, group = s.heads / s.kv_heads;
  const T* base = qkv + int64_t(b) * s.seq * s.width;
  const T* dout_base = dout + int64_t(b) * s.seq * s.out_width;
  LoadKeyValueTiles(base, s, g, k0, k, v);
  for (int i = threadIdx.x; i < kTileFloats; i += kThreads) dk[i] = 0.0f, dv[i] = 0.0f;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tiles = (s.seq + kTile - 1) / kTile;
  for (int h = g * group; h < (g + 1) * group; ++h) {
    const float* lse_h = lse + (int64_t(b) * s.heads + h) * s.seq;
    const float* delta_h = delta + (int64_t(b) * s.heads + h) * s.seq;
    for (int t = blockIdx.x; t < tiles; ++t) {  // query tiles at or below the diagonal
      const int q0 = t * kTile;
      __syncthreads();  // the previous tile's Q, dO, P, dS are no longer read
      LoadTile(base, s.width, int64_t(h) * kHeadDim, q0, s.seq, q);
      LoadTile(dout_base, s.out_width, int64_t(h) * kHeadDim, q0, s.seq, d_o);
      LoadRowStats(lse_h, delta_h, q0, s.seq, lse_rows, delta_rows);
      __syncthreads();
      // Each warp: its 16 query rows of S and dP, then P and dS.
      ProbsAndScoreGradients(s, q0, k0, q, d_o, k, v, lse_rows, delta_rows, scores, dprobs, p, ds);
      __syncthreads();
      // Each warp: its 16 key rows of dV += Pᵀ dO and dK += dSᵀ Q.
      WarpGemmTransA16x64(p + warp * kFrag, kLd, d_o, kLd, dv + warp * kFrag * kLdF, kLdF);
      WarpGemmTransA16x64(ds + warp * kFrag, kLd, q, kLd, dk + warp * kFrag * kLdF, kLdF);
    }
  }
  __syncthreads();
  T* dbase = dqkv + int64_t(b) * s.seq * s.width;
  for (int r = warp * kFrag; r < (warp + 1) * kFrag; ++r) {
    if (k0 + r >= s.seq) break;
    T* row = dbase + int64_t(k0 + r) * s.width;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = lane + 32 * j;
      row[int64_t(s.heads + g) * kHeadDim + c] = FromFloat<T>(dk[r * kLdF + c] * s.scale);
      row[int64_t(s.heads + s.kv_heads + g) * kHeadDim + c] = FromFloat<T>(dv[r * kLdF + c]);
    }
  }
}

constexpr size_t kDqSmem = 5 * kTileElems * 2 /* Q, dO, K, V, dS */ + 3 * kTileFloats * 4 /* dQ, S, dP */ +
                           2 * kTile * 4 /* lse, delta */;

// One query tile of one head: dQ summed over the key tiles up to the diagonal.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    FlashBackwardQKernel(const T* qkv, const T* dout, const float* lse, const float* delta, Shape s, T* dqkv) {
  extern __shared__ __align__(128) unsigned char smem[];
  T* q = reinterpret_cast<T*>(smem);
  T* d_o = q + kTileElems;
  T* k = d_o + kTileElems;
  T* v = k + kTileElems;
  T* ds = v + kTileElems;
  float* dq = reinterpret_cast<float*>(ds + kTileElems);
  float* scores = dq + kTileFloats;
  float* dprobs = scores + kTileFloats;
  float* lse_rows = dprobs + kTileFloats;
  float* delta_rows = lse_rows + kTile;

  const int q0 = blockIdx.x * kTile;
  const int b = blockIdx.y / s.heads, h = blockIdx.y % s.heads, g = h / (s.heads / s.kv_heads);
  const T* base = qkv + int64_t(b) * s.seq * s.width;
  LoadTile(base, s.width, int64_t(h) * kHeadDim, q0, s.seq, q);
  LoadTile(dout + int64_t(b) * s.seq * s.out_width, s.out_width, int64_t(h) * kHeadDim, q0, s.seq, d_o);
  const float* lse_h = lse + (int64_t(b) * s.heads + h) * s.seq;
  const float* delta_h = delta + (int64_t(b) * s.heads + h) * s.seq;
  LoadRowStats(lse_h, delta_h, q0, s.seq, lse_rows, delta_rows);
  for (int i = threadIdx.x; i < kTileFloats; i += kThreads) dq[i] = 0.0f;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int t = 0; t <= int(blockIdx.x); ++t) {
    const int k0 = t * kTile;
    __syncthreads();
    LoadKeyValueTiles(base, s, g, k0, k, v);
    __syncthreads();
    ProbsAndScoreGradients<T>(s, q0, k0, q, d_o, k, v, lse_rows, delta_rows, scores, dprobs, nullptr, ds);
    __syncwarp();
    // The warp's 16 rows of dQ += dS K: only its own rows of dS are read.
    WarpGemm16x64<T, true, true>(ds + warp * kFrag * kLd, kLd, k, kLd, dq + warp * kFrag * kLdF, kLdF);
  }
  __syncthreads();
  T* dbase = dqkv + int64_t(b) * s.seq * s.width;
  for (int r = warp * kFrag; r < (warp + 1) * kFrag; ++r) {
    if (q0 + r >= s.seq) break;
    T* row = dbase + int64_t(q0 + r) * s.width + int64_t(h) * kHeadDim;
    row[lane] = FromFloat<T>(dq[r * kLdF + lane] * s.scale);
    row[lane + 32] = FromFloat<T>(dq[r * kLdF + lane + 32] * s.scale);
  }
}

Shape MakeShape(int seq, int heads, int kv_heads) {
  return {seq, heads, kv_heads, int64_t(heads + 2 * kv_heads) * kHeadDim, int64_t(heads) * kHeadDim,
          1.0f / std::sqrt(float(kHeadDim))};
}

// Raises a kernel's dynamic shared-memory limit (above the default 48 KB).
template <typename Kernel>
cudaError_t AllowSmem(Kernel kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

template <typename T>
cudaError_t Forward(const void* qkv, int batch, int seq, int heads, int kv_heads, void* out, float* lse,
                    cudaStream_t stream) {
  static const cudaError_t allowed = AllowSmem(FlashForwardKernel<T>, kForwardSmem);
  if (allowed != cudaSuccess) return allowed;
  const dim3 grid((seq + kTile - 1) / kTile, batch * heads);
  FlashForwardKernel<T><<<grid, kThreads, kForwardSmem, stream>>>(static_cast<const T*>(qkv),
                                                                   MakeShape(seq, heads, kv_heads),
                                                                   static_cast<T*>(out), lse);
  return cudaGetLastError();
}

template <typename T>
cudaError_t Backward(const void* qkv, const void* out, const void* dout, const float* lse, int batch, int seq,
                     int heads, int kv_heads, float* delta, void* dqkv, cudaStream_t stream) {
  static const cudaError_t allowed_kv = AllowSmem(FlashBackwardKvKernel<T>, kDkvSmem);
  static const cudaError_t allowed_q = AllowSmem(FlashBackwardQKernel<T>, kDqSmem);
  if (allowed_kv != cudaSuccess) return allowed_kv;
  if (allowed_q != cudaSuccess) return allowed_q;
  const Shape s = MakeShape(seq, heads, kv_heads);
  const T* q = static_cast<const T*>(qkv);
  const T* d = static_cast<const T*>(dout);
  const int rows = batch * seq * heads;
  const int blocks = std::min((rows + 7) / 8, 65535);  // 8 warps of a 256-thread block, a row each
  DeltaKernel<T><<<blocks, 256, 0, stream>>>(static_cast<const T*>(out), d, s, rows, delta);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const int tiles = (seq + kTile - 1) / kTile;
  FlashBackwardKvKernel<T><<<dim3(tiles, batch * kv_heads), kThreads, kDkvSmem, stream>>>(
      q, d, lse, delta, s, static_cast<T*>(dqkv));
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  FlashBackwardQKernel<T><<<dim3(tiles, batch * heads), kThreads, kDqSmem, stream>>>(q, d, lse, delta, s,
                                                                                       static_cast<T*>(dqkv));
  return cudaGetLastError();
}

}  // namespace

namespace internal {

int FlashAttentionHeadDim() { return kHeadDim; }

cudaError_t FlashAttentionForward(bool bf16, const void* qkv, int batch, int seq, int heads, int kv_heads, void* out,
                                  float* lse, cudaStream_t stream) {
  return bf16 ? Forward<__nv_bfloat16>(qkv, batch, seq, heads, kv_heads, out, lse, stream)
              : Forward<__half>(qkv, batch, seq, heads, kv_heads, out, lse, stream);
}

cudaError_t FlashAttentionBackward(bool bf16, const void* qkv, const void* out, const void* dout, const float* lse,
                                   int batch, int seq, int heads, int kv_heads, float* delta, void* dqkv,
                                   cudaStream_t stream) {
  return bf16 ? Backward<__nv_bfloat16>(qkv, out, dout, lse, batch, seq, heads, kv_heads, delta, dqkv, stream)
              : Backward<__half>(qkv, out, dout, lse, batch, seq, heads, kv_heads, delta, dqkv, stream);
}

}  // namespace internal

}  // namespace estuary::models::cuda
