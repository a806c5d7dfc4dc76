// Flash attention's backward kernels (flash_attention.h); flash_attention.cc
// checks the arguments.
//
// Three launches, no atomics, so results repeat bit for bit:
//  - delta = rowsum(dO ∘ O), one warp per row;
//  - dK and dV per key tile of a kv head: each of 4 warps owns 16 key rows
//    and keeps K, V (as A fragments) and the dK, dV accumulators in
//    registers while the kv head's query heads (ascending) and, for each,
//    the query tiles from the diagonal down stream past it through two
//    shared-memory buffers. A warp computes Sᵀ = K Qᵀ rather than S, so that
//    Pᵀ and dSᵀ come out as C fragments with keys as rows: exactly the A
//    operands of dV += Pᵀ dO and dK += dSᵀ Q;
//  - dQ per query tile of a head: each warp keeps its rows of Q, dO (A
//    fragments), lse, delta and the dQ accumulator in registers while the key
//    tiles up to the diagonal stream past.
// P is recomputed from the forward's log-sum-exp in both; dS = P (dP - delta)
// uses P in fp32 and is rounded to T as an operand, as P is.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "models/cuda/flash_attention_mma.cuh"
#include "models/cuda/kernel_common.cuh"

namespace estuary::models::cuda {

namespace {

using namespace flash;
using internal::ToFloat;

__device__ inline float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// delta[b, h, i] = Σ_c dout[i, c] out[i, c]: one warp per row, two columns a lane.
template <typename T>
__global__ void DeltaKernel(const T* out, const T* dout, Shape s, int rows, float* delta) {
  const int lane = threadIdx.x % 32;
  for (int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < rows;
       r += int64_t(gridDim.x) * blockDim.x / 32) {
    const int h = int(r % s.heads);
    const int64_t token = r / s.heads;  // b * seq + i
    const T* o = out + token * s.out_width + int64_t(h) * kHeadDim + 2 * lane;
    const T* d = dout + token * s.out_width + int64_t(h) * kHeadDim + 2 * lane;
    const float sum = WarpSum(ToFloat(o[0]) * ToFloat(d[0]) + ToFloat(o[1]) * ToFloat(d[1]));
    if (lane == 0) {
      const int64_t b = token / s.seq, i = token % s.seq;
      delta[(b * s.heads + h) * s.seq + i] = sum;
    }
  }
}

// ------------------------------------------------------------- dK and dV

// K, V; then Q, dO, lse, delta twice (double-buffered): 49 KB.
constexpr size_t kRowStatsBytes = 2 * kTile * sizeof(float);  // lse, delta of one query tile
constexpr size_t kDkvSmem = 6 * kTileElems * 2 + 2 * kRowStatsBytes;
constexpr int kBufferElems = 2 * kTileElems;  // a pair of tiles: (Q, dO) here, (K, V) in dQ's kernel

// One key tile of one kv head: dK and dV summed over the head's query heads
// (ascending) and the query tiles from the diagonal down.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    FlashBackwardKvKernel(const T* qkv, const T* dout, const float* lse, const float* delta, Shape s, T* dqkv) {
  extern __shared__ __align__(128) unsigned char smem[];
  // K, V, then (Q, dO) for even steps and for odd ones, then (lse, delta)
  // rows for even steps and for odd ones. Buffers are found by arithmetic,
  // not through arrays of pointers (indexed at run time: local memory).
  T* k_tile = reinterpret_cast<T*>(smem);
  T* v_tile = k_tile + kTileElems;
  T* q_tiles = k_tile + 2 * kTileElems;  // buffer i: q_tiles + i * kBufferElems
  T* do_tiles = q_tiles + kTileElems;
  float* stats = reinterpret_cast<float*>(k_tile + 6 * kTileElems);  // buffer i: stats + i * 2 * kTile

  const int key_tile = blockIdx.x;  // tile 0 has the most work and starts first
  const int k0 = key_tile * kTile;
  const int b = blockIdx.y / s.kv_heads, g = blockIdx.y % s.kv_heads, group = s.heads / s.kv_heads;
  const T* base = qkv + int64_t(b) * s.seq * s.width;
  const T* dout_base = dout + int64_t(b) * s.seq * s.out_width;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);
  const int query_tiles = (s.seq + kTile - 1) / kTile;
  const int per_head = query_tiles - key_tile;  // query tiles at or below the diagonal
  const int steps = group * per_head;

  // Step i: query head g * group + i / per_head, query tile key_tile + i % per_head.
  auto load_step = [&](int i, int buffer) {
    const int h = g * group + i / per_head, q0 = (key_tile + i % per_head) * kTile;
    LoadTileAsync(base, s.width, int64_t(h) * kHeadDim, q0, s.seq, q_tiles + buffer * kBufferElems);
    LoadTileAsync(dout_base, s.out_width, int64_t(h) * kHeadDim, q0, s.seq, do_tiles + buffer * kBufferElems);
    // Threads 0-63 copy lse, 64-127 delta; rows past seq become 0 (masked below).
    const int r = threadIdx.x % kTile;
    const float* src = (threadIdx.x < kTile ? lse : delta) + (int64_t(b) * s.heads + h) * s.seq;
    const bool valid = q0 + r < s.seq;
    CopyAsync4(stats + buffer * 2 * kTile + threadIdx.x, src + (valid ? q0 + r : 0), valid);
  };
  static_assert(kThreads == 2 * kTile, "load_step copies lse and delta one row a thread");

  LoadTileAsync(base, s.width, int64_t(s.heads + g) * kHeadDim, k0, s.seq, k_tile);
  LoadTileAsync(base, s.width, int64_t(s.heads + s.kv_heads + g) * kHeadDim, k0, s.seq, v_tile);
  load_step(0, 0);
  CommitCopies();

  uint32_t k_frag[4][4], v_frag[4][4];
  float dk[8][4], dv[8][4];
  Zero(dk);
  Zero(dv);
  const float scale_log2 = s.scale * kLog2e;

  for (int i = 0; i < steps; ++i) {
    WaitForCopies();
    __syncthreads();  // step i has landed, and every warp is done with step i - 1's buffers
    if (i + 1 < steps) load_step(i + 1, (i + 1) & 1);
    CommitCopies();
    if (i == 0) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        LoadA(k_frag[kk], k_tile, 16 * warp, 16 * kk);
        LoadA(v_frag[kk], v_tile, 16 * warp, 16 * kk);
      }
    }
    const int query_tile = key_tile + i % per_head;
    const int q0 = query_tile * kTile;
    const T* q_tile = q_tiles + (i & 1) * kBufferElems;
    const T* do_tile = do_tiles + (i & 1) * kBufferElems;
    const float* lse_rows = stats + (i & 1) * 2 * kTile;  // lse, then delta
    const float* delta_rows = lse_rows + kTile;

    // Sᵀ = K Qᵀ, then Pᵀ in place: rows are this warp's keys, columns queries.
    float probs[8][4];
    Zero(probs);
    MmaTransposedTile<T>(probs, k_frag, q_tile);
    const bool masked = query_tile == key_tile || q0 + kTile > s.seq;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float2 l = *reinterpret_cast<const float2*>(lse_rows + 8 * j + quad_col);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = 8 * j + quad_col + (e & 1);
        float p = Exp2(probs[j][e] * scale_log2 - ((e & 1) ? l.y : l.x) * kLog2e);
        if (masked) {
          const int r = 16 * warp + quad_row + (e >= 2 ? 8 : 0);
          if (k0 + r > q0 + c || q0 + c >= s.seq) p = 0.0f;
        }
        probs[j][e] = p;
      }
    }
    // dPᵀ = V dOᵀ, then dSᵀ = Pᵀ (dPᵀ - delta) in place.
    float dscores[8][4];
    Zero(dscores);
    MmaTransposedTile<T>(dscores, v_frag, do_tile);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float2 d = *reinterpret_cast<const float2*>(delta_rows + 8 * j + quad_col);
#pragma unroll
      for (int e = 0; e < 4; ++e) dscores[j][e] = probs[j][e] * (dscores[j][e] - ((e & 1) ? d.y : d.x));
    }
    MmaFromAccumulators<T>(dv, probs, do_tile);   // dV += Pᵀ dO
    MmaFromAccumulators<T>(dk, dscores, q_tile);  // dK += dSᵀ Q
  }

  T* dbase = dqkv + int64_t(b) * s.seq * s.width;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int kr = k0 + 16 * warp + quad_row + 8 * half;
    if (kr >= s.seq) continue;
    T* row = dbase + int64_t(kr) * s.width + quad_col;
    T* dk_row = row + int64_t(s.heads + g) * kHeadDim;
    T* dv_row = row + int64_t(s.heads + s.kv_heads + g) * kHeadDim;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      StorePair(dk_row + 8 * j, dk[j][2 * half] * s.scale, dk[j][2 * half + 1] * s.scale);
      StorePair(dv_row + 8 * j, dv[j][2 * half], dv[j][2 * half + 1]);
    }
  }
}

// ------------------------------------------------------------------- dQ

constexpr size_t kDqSmem = 6 * kTileElems * 2;  // Q, dO, then K and V twice: 48 KB

// One query tile of one head: dQ summed over the key tiles up to the diagonal.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    FlashBackwardQKernel(const T* qkv, const T* dout, const float* lse, const float* delta, Shape s, T* dqkv) {
  extern __shared__ __align__(128) unsigned char smem[];
  T* q_tile = reinterpret_cast<T*>(smem);
  T* do_tile = q_tile + kTileElems;
  T* k_tiles = q_tile + 2 * kTileElems;  // buffer i: k_tiles + i * kBufferElems
  T* v_tiles = k_tiles + kTileElems;

  const int query_tile = int(gridDim.x) - 1 - int(blockIdx.x);  // the longest first
  const int q0 = query_tile * kTile;
  const int b = blockIdx.y / s.heads, h = blockIdx.y % s.heads, g = h / (s.heads / s.kv_heads);
  const T* base = qkv + int64_t(b) * s.seq * s.width;
  const int64_t k_column = int64_t(s.heads + g) * kHeadDim, v_column = int64_t(s.heads + s.kv_heads + g) * kHeadDim;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);

  LoadTileAsync(base, s.width, int64_t(h) * kHeadDim, q0, s.seq, q_tile);
  LoadTileAsync(dout + int64_t(b) * s.seq * s.out_width, s.out_width, int64_t(h) * kHeadDim, q0, s.seq, do_tile);
  LoadTileAsync(base, s.width, k_column, 0, s.seq, k_tiles);
  LoadTileAsync(base, s.width, v_column, 0, s.seq, v_tiles);
  CommitCopies();

  // This thread's rows: lse in log2 units and delta (rows past seq: anything
  // finite, their dQ is not written).
  float row_lse[2], row_delta[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int qi = q0 + 16 * warp + quad_row + 8 * half;
    const int64_t at = (int64_t(b) * s.heads + h) * s.seq + qi;
    row_lse[half] = qi < s.seq ? lse[at] * kLog2e : 0.0f;
    row_delta[half] = qi < s.seq ? delta[at] : 0.0f;
  }
  uint32_t q_frag[4][4], do_frag[4][4];
  float dq[8][4];
  Zero(dq);
  const float scale_log2 = s.scale * kLog2e;

  const int tiles = query_tile + 1;
  for (int t = 0; t < tiles; ++t) {
    WaitForCopies();
    __syncthreads();  // tile t has landed, and every warp is done with tile t - 1's buffers
    if (t + 1 < tiles) {
      LoadTileAsync(base, s.width, k_column, (t + 1) * kTile, s.seq, k_tiles + ((t + 1) & 1) * kBufferElems);
      LoadTileAsync(base, s.width, v_column, (t + 1) * kTile, s.seq, v_tiles + ((t + 1) & 1) * kBufferElems);
    }
    CommitCopies();
    if (t == 0) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        LoadA(q_frag[kk], q_tile, 16 * warp, 16 * kk);
        LoadA(do_frag[kk], do_tile, 16 * warp, 16 * kk);
      }
    }
    const T* k_tile = k_tiles + (t & 1) * kBufferElems;
    const T* v_tile = v_tiles + (t & 1) * kBufferElems;

    float probs[8][4];
    Zero(probs);
    MmaTransposedTile<T>(probs, q_frag, k_tile);  // S = Q Kᵀ
    float dscores[8][4];
    Zero(dscores);
    MmaTransposedTile<T>(dscores, do_frag, v_tile);  // dP = dO Vᵀ
    // The diagonal tile masks key c past row r; keys past seq only occur
    // there, past every real row.
    const bool diagonal = t == query_tile;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int half = e >> 1;
        float p = Exp2(probs[j][e] * scale_log2 - row_lse[half]);
        if (diagonal && 8 * j + quad_col + (e & 1) > 16 * warp + quad_row + 8 * half) p = 0.0f;
        dscores[j][e] = p * (dscores[j][e] - row_delta[half]);
      }
    }
    MmaFromAccumulators<T>(dq, dscores, k_tile);  // dQ += dS K
  }

  T* dbase = dqkv + int64_t(b) * s.seq * s.width;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int qi = q0 + 16 * warp + quad_row + 8 * half;
    if (qi >= s.seq) continue;
    T* row = dbase + int64_t(qi) * s.width + int64_t(h) * kHeadDim + quad_col;
#pragma unroll
    for (int j = 0; j < 8; ++j) StorePair(row + 8 * j, dq[j][2 * half] * s.scale, dq[j][2 * half + 1] * s.scale);
  }
}

template <typename Kernel>
cudaError_t AllowSmem(Kernel kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
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

cudaError_t FlashAttentionBackward(bool bf16, const void* qkv, const void* out, const void* dout, const float* lse,
                                   int batch, int seq, int heads, int kv_heads, float* delta, void* dqkv,
                                   cudaStream_t stream) {
  return bf16 ? Backward<__nv_bfloat16>(qkv, out, dout, lse, batch, seq, heads, kv_heads, delta, dqkv, stream)
              : Backward<__half>(qkv, out, dout, lse, batch, seq, heads, kv_heads, delta, dqkv, stream);
}

}  // namespace internal

}  // namespace estuary::models::cuda
