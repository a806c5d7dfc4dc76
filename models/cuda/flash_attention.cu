// The kernels of flash_attention.h; flash_attention.cc checks the arguments.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace estuary::models::cuda {

namespace {

using namespace nvcuda;

constexpr int kHeadDim = 64;  // the one head size compiled
constexpr int kTile = 64;     // query rows and key rows per tile
constexpr int kWarps = 4;     // each warp owns 16 rows of a tile
constexpr int kThreads = kWarps * 32;
constexpr int kFrag = 16;     // WMMA's m = n = k
// The softmax loops give each of two lanes 32 columns of a 64-wide row, for
// the score tile and the output tile alike.
static_assert(kTile == kHeadDim && kTile == 64, "the row loops assume 64-wide tiles");

template <typename T>
__device__ inline float ToF(T v);
template <>
__device__ inline float ToF<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ inline float ToF<__half>(__half v) { return __half2float(v); }
template <typename T>
__device__ inline T FromF(float v);
template <>
__device__ inline __nv_bfloat16 FromF<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ inline __half FromF<__half>(float v) { return __float2half_rn(v); }

// Copies rows [row0, row0 + kTile) of one head (kHeadDim columns at `column`)
// of a [n, width] matrix into a dense tile; rows past seq become zero.
template <typename T>
__device__ void LoadTile(const T* base, int64_t width, int64_t column, int row0, int seq, T* tile) {
  for (int i = threadIdx.x; i < kTile * kHeadDim; i += kThreads) {
    const int r = i / kHeadDim, c = i % kHeadDim;
    tile[i] = row0 + r < seq ? base[int64_t(row0 + r) * width + column + c] : FromF<T>(0.0f);
  }
}

// C[16 x 64] (fp32, row-major, ldc) = or += A[16 x 64] · B[64 x 64], one warp.
// A is row-major with lda; B is row-major (b_row_major) or its transpose
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
        wmma::load_matrix_sync(fb, b + int64_t(kt) * kFrag * ldb + nt * kFrag, ldb);
      } else {
        wmma::load_matrix_sync(fb, b + int64_t(nt) * kFrag * ldb + kt * kFrag, ldb);
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
      wmma::load_matrix_sync(fa, a + int64_t(kt) * kFrag * lda, lda);
      wmma::load_matrix_sync(fb, b + int64_t(kt) * kFrag * ldb + nt * kFrag, ldb);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(c + nt * kFrag, acc, ldc, wmma::mem_row_major);
  }
}

struct Shape {
  int seq, heads, kv_heads;
  int64_t width, out_width;  // elements per row of qkv and of out
  float scale;               // 1 / sqrt(head_dim)
};

// ---------------------------------------------------------------- forward

constexpr size_t kForwardSmem = 3 * kTile * kHeadDim * 2 /* Q, K, V */ + kTile * kTile * 4 /* S */ +
                                kTile * kTile * 2 /* P */ + kTile * kHeadDim * 4 /* O */ + 2 * kTile * 4 /* m, l */;

template <typename T>
__global__ void __launch_bounds__(kThreads) FlashForwardKernel(const T* qkv, Shape s, T* out, float* lse) {
  extern __shared__ __align__(128) unsigned char smem[];
  T* q = reinterpret_cast<T*>(smem);
  T* k = q + kTile * kHeadDim;
  T* v = k + kTile * kHeadDim;
  float* scores = reinterpret_cast<float*>(v + kTile * kHeadDim);
  T* p = reinterpret_cast<T*>(scores + kTile * kTile);
  float* o = reinterpret_cast<float*>(p + kTile * kTile);
  float* row_max = o + kTile * kHeadDim;
  float* row_sum = row_max + kTile;

  const int q0 = blockIdx.x * kTile;
  const int b = blockIdx.y / s.heads, h = blockIdx.y % s.heads, g = h / (s.heads / s.kv_heads);
  const T* base = qkv + int64_t(b) * s.seq * s.width;
  LoadTile(base, s.width, int64_t(h) * kHeadDim, q0, s.seq, q);
  for (int i = threadIdx.x; i < kTile * kHeadDim; i += kThreads) o[i] = 0.0f;
  for (int i = threadIdx.x; i < kTile; i += kThreads) row_max[i] = -INFINITY, row_sum[i] = 0.0f;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = warp * kFrag + lane / 2, half = lane % 2;  // two lanes per row, 32 columns each
  const int qi = q0 + row;
  const int tiles = min((s.seq + kTile - 1) / kTile, blockIdx.x + 1);  // up to the diagonal
  for (int t = 0; t < tiles; ++t) {
    const int k0 = t * kTile;
    __syncthreads();  // the previous tile's K and V are no longer read
    LoadTile(base, s.width, int64_t(s.heads + g) * kHeadDim, k0, s.seq, k);
    LoadTile(base, s.width, int64_t(s.heads + s.kv_heads + g) * kHeadDim, k0, s.seq, v);
    __syncthreads();
    WarpGemm16x64<T, false, false>(q + warp * kFrag * kHeadDim, kHeadDim, k, kHeadDim,
                                   scores + warp * kFrag * kTile, kTile);
    __syncwarp();
    // Online softmax over this tile's columns of the row.
    float* srow = scores + row * kTile;
    float tile_max = -INFINITY;
    for (int c = half * 32; c < half * 32 + 32; ++c) {
      const int kj = k0 + c;
      const float x = kj <= qi && kj < s.seq ? srow[c] * s.scale : -INFINITY;
      srow[c] = x;
      tile_max = fmaxf(tile_max, x);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    const float old_max = row_max[row];
    const float new_max = fmaxf(old_max, tile_max);
    // A row with nothing unmasked yet (padding past seq) keeps its zeros.
    const float alpha = new_max == -INFINITY ? 1.0f : __expf(old_max - new_max);
    float sum = 0.0f;
    for (int c = half * 32; c < half * 32 + 32; ++c) {
      const float e = srow[c] == -INFINITY ? 0.0f : __expf(srow[c] - new_max);
      p[row * kTile + c] = FromF<T>(e);
      sum += e;
      o[row * kHeadDim + c] *= alpha;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    __syncwarp();
    if (half == 0) {
      row_sum[row] = row_sum[row] * alpha + sum;
      row_max[row] = new_max;
    }
    WarpGemm16x64<T, true, true>(p + warp * kFrag * kTile, kTile, v, kHeadDim, o + warp * kFrag * kHeadDim,
                                 kHeadDim);
    __syncwarp();
  }
  if (qi < s.seq) {
    const float inv = 1.0f / row_sum[row];
    T* dst = out + (int64_t(b) * s.seq + qi) * s.out_width + int64_t(h) * kHeadDim;
    for (int c = half * 32; c < half * 32 + 32; ++c) dst[c] = FromF<T>(o[row * kHeadDim + c] * inv);
    if (half == 0) lse[(int64_t(b) * s.heads + h) * s.seq + qi] = row_max[row] + logf(row_sum[row]);
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
    float sum = 0.0f;
    for (int c = lane; c < kHeadDim; c += 32) sum += ToF(o[c]) * ToF(d[c]);
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
    if (lane == 0) {
      const int64_t b = token / s.seq, i = token % s.seq;
      delta[(b * s.heads + h) * s.seq + i] = sum;
    }
  }
}

// For one warp's 16 rows of a (query tile, key tile) pair, with S = Q Kᵀ and
// dP = dO Vᵀ already in `scores` and `dprobs`: P (fp32 into scores, and the
// low-precision copy into p) and dS = P (dP - delta) into ds.
template <typename T>
__device__ void ProbsAndScoreGradients(const Shape& s, int q0, int k0, const float* lse_rows,
                                       const float* delta_rows, float* scores, const float* dprobs, T* p, T* ds) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = warp * kFrag + lane / 2, half = lane % 2;
  const int qi = q0 + row;
  for (int c = half * 32; c < half * 32 + 32; ++c) {
    const int kj = k0 + c;
    const bool live = qi < s.seq && kj < s.seq && kj <= qi;
    const float prob = live ? __expf(scores[row * kTile + c] * s.scale - lse_rows[row]) : 0.0f;
    const float grad = prob * (dprobs[row * kTile + c] - delta_rows[row]);
    if (p) p[row * kTile + c] = FromF<T>(prob);
    ds[row * kTile + c] = FromF<T>(grad);
  }
}

constexpr size_t kDkvSmem = 4 * kTile * kHeadDim * 2 /* K, V, Q, dO */ + 2 * kTile * kHeadDim * 4 /* dK, dV */ +
                            2 * kTile * kTile * 4 /* S, dP */ + 2 * kTile * kTile * 2 /* P, dS */ +
                            2 * kTile * 4 /* lse, delta */;

// One key tile of one kv head: dK and dV summed over the head's query heads
// (ascending) and the query tiles from the diagonal down.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    FlashBackwardKvKernel(const T* qkv, const T* dout, const float* lse, const float* delta, Shape s, T* dqkv) {
  extern __shared__ __align__(128) unsigned char smem[];
  T* k = reinterpret_cast<T*>(smem);
  T* v = k + kTile * kHeadDim;
  T* q = v + kTile * kHeadDim;
  T* d_o = q + kTile * kHeadDim;
  float* dk = reinterpret_cast<float*>(d_o + kTile * kHeadDim);
  float* dv = dk + kTile * kHeadDim;
  float* scores = dv + kTile * kHeadDim;
  float* dprobs = scores + kTile * kTile;
  T* p = reinterpret_cast<T*>(dprobs + kTile * kTile);
  T* ds = p + kTile * kTile;
  float* lse_rows = reinterpret_cast<float*>(ds + kTile * kTile);
  float* delta_rows = lse_rows + kTile;

  const int k0 = blockIdx.x * kTile;
  const int b = blockIdx.y / s.kv_heads, g = blockIdx.y % s.kv_heads, group = s.heads / s.kv_heads;
  const T* base = qkv + int64_t(b) * s.seq * s.width;
  const T* dout_base = dout + int64_t(b) * s.seq * s.out_width;
  LoadTile(base, s.width, int64_t(s.heads + g) * kHeadDim, k0, s.seq, k);
  LoadTile(base, s.width, int64_t(s.heads + s.kv_heads + g) * kHeadDim, k0, s.seq, v);
  for (int i = threadIdx.x; i < kTile * kHeadDim; i += kThreads) dk[i] = 0.0f, dv[i] = 0.0f;
  const int warp = threadIdx.x / 32;
  const int tiles = (s.seq + kTile - 1) / kTile;
  for (int h = g * group; h < (g + 1) * group; ++h) {
    const float* lse_h = lse + (int64_t(b) * s.heads + h) * s.seq;
    const float* delta_h = delta + (int64_t(b) * s.heads + h) * s.seq;
    for (int t = blockIdx.x; t < tiles; ++t) {  // query tiles at or below the diagonal
      const int q0 = t * kTile;
      __syncthreads();  // the previous tile's Q, dO, P, dS are no longer read
      LoadTile(base, s.width, int64_t(h) * kHeadDim, q0, s.seq, q);
      LoadTile(dout_base, s.out_width, int64_t(h) * kHeadDim, q0, s.seq, d_o);
      for (int i = threadIdx.x; i < kTile; i += kThreads) {
        lse_rows[i] = q0 + i < s.seq ? lse_h[q0 + i] : 0.0f;
        delta_rows[i] = q0 + i < s.seq ? delta_h[q0 + i] : 0.0f;
      }
      __syncthreads();
      // Each warp: its 16 query rows of S = Q Kᵀ and dP = dO Vᵀ, then P and dS.
      WarpGemm16x64<T, false, false>(q + warp * kFrag * kHeadDim, kHeadDim, k, kHeadDim,
                                     scores + warp * kFrag * kTile, kTile);
      WarpGemm16x64<T, false, false>(d_o + warp * kFrag * kHeadDim, kHeadDim, v, kHeadDim,
                                     dprobs + warp * kFrag * kTile, kTile);
      __syncwarp();
      ProbsAndScoreGradients(s, q0, k0, lse_rows, delta_rows, scores, dprobs, p, ds);
      __syncthreads();
      // Each warp: its 16 key rows of dV += Pᵀ dO and dK += dSᵀ Q.
      WarpGemmTransA16x64(p + warp * kFrag, kTile, d_o, kHeadDim, dv + warp * kFrag * kHeadDim, kHeadDim);
      WarpGemmTransA16x64(ds + warp * kFrag, kTile, q, kHeadDim, dk + warp * kFrag * kHeadDim, kHeadDim);
    }
  }
  __syncthreads();
  T* dbase = dqkv + int64_t(b) * s.seq * s.width;
  for (int i = threadIdx.x; i < kTile * kHeadDim; i += kThreads) {
    const int r = i / kHeadDim, c = i % kHeadDim;
    if (k0 + r >= s.seq) continue;
    T* row = dbase + int64_t(k0 + r) * s.width;
    row[int64_t(s.heads + g) * kHeadDim + c] = FromF<T>(dk[i] * s.scale);
    row[int64_t(s.heads + s.kv_heads + g) * kHeadDim + c] = FromF<T>(dv[i]);
  }
}

constexpr size_t kDqSmem = 4 * kTile * kHeadDim * 2 /* Q, dO, K, V */ + kTile * kHeadDim * 4 /* dQ */ +
                           2 * kTile * kTile * 4 /* S, dP */ + kTile * kTile * 2 /* dS */ + 2 * kTile * 4;

// One query tile of one head: dQ summed over the key tiles up to the diagonal.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    FlashBackwardQKernel(const T* qkv, const T* dout, const float* lse, const float* delta, Shape s, T* dqkv) {
  extern __shared__ __align__(128) unsigned char smem[];
  T* q = reinterpret_cast<T*>(smem);
  T* d_o = q + kTile * kHeadDim;
  T* k = d_o + kTile * kHeadDim;
  T* v = k + kTile * kHeadDim;
  float* dq = reinterpret_cast<float*>(v + kTile * kHeadDim);
  float* scores = dq + kTile * kHeadDim;
  float* dprobs = scores + kTile * kTile;
  T* ds = reinterpret_cast<T*>(dprobs + kTile * kTile);
  float* lse_rows = reinterpret_cast<float*>(ds + kTile * kTile);
  float* delta_rows = lse_rows + kTile;

  const int q0 = blockIdx.x * kTile;
  const int b = blockIdx.y / s.heads, h = blockIdx.y % s.heads, g = h / (s.heads / s.kv_heads);
  const T* base = qkv + int64_t(b) * s.seq * s.width;
  LoadTile(base, s.width, int64_t(h) * kHeadDim, q0, s.seq, q);
  LoadTile(dout + int64_t(b) * s.seq * s.out_width, s.out_width, int64_t(h) * kHeadDim, q0, s.seq, d_o);
  const float* lse_h = lse + (int64_t(b) * s.heads + h) * s.seq;
  const float* delta_h = delta + (int64_t(b) * s.heads + h) * s.seq;
  for (int i = threadIdx.x; i < kTile; i += kThreads) {
    lse_rows[i] = q0 + i < s.seq ? lse_h[q0 + i] : 0.0f;
    delta_rows[i] = q0 + i < s.seq ? delta_h[q0 + i] : 0.0f;
  }
  for (int i = threadIdx.x; i < kTile * kHeadDim; i += kThreads) dq[i] = 0.0f;
  const int warp = threadIdx.x / 32;
  for (int t = 0; t <= int(blockIdx.x); ++t) {
    const int k0 = t * kTile;
    __syncthreads();
    LoadTile(base, s.width, int64_t(s.heads + g) * kHeadDim, k0, s.seq, k);
    LoadTile(base, s.width, int64_t(s.heads + s.kv_heads + g) * kHeadDim, k0, s.seq, v);
    __syncthreads();
    WarpGemm16x64<T, false, false>(q + warp * kFrag * kHeadDim, kHeadDim, k, kHeadDim,
                                   scores + warp * kFrag * kTile, kTile);
    WarpGemm16x64<T, false, false>(d_o + warp * kFrag * kHeadDim, kHeadDim, v, kHeadDim,
                                   dprobs + warp * kFrag * kTile, kTile);
    __syncwarp();
    ProbsAndScoreGradients<T>(s, q0, k0, lse_rows, delta_rows, scores, dprobs, nullptr, ds);
    __syncwarp();
    // The warp's 16 rows of dQ += dS K: only its own rows of dS are read.
    WarpGemm16x64<T, true, true>(ds + warp * kFrag * kTile, kTile, k, kHeadDim, dq + warp * kFrag * kHeadDim,
                                 kHeadDim);
  }
  __syncthreads();
  T* dbase = dqkv + int64_t(b) * s.seq * s.width;
  for (int i = threadIdx.x; i < kTile * kHeadDim; i += kThreads) {
    const int r = i / kHeadDim, c = i % kHeadDim;
    if (q0 + r < s.seq) dbase[int64_t(q0 + r) * s.width + int64_t(h) * kHeadDim + c] = FromF<T>(dq[i] * s.scale);
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
