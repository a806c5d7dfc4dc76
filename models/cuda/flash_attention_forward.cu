// Flash attention's forward kernel (flash_attention.h); flash_attention.cc
// checks the arguments.
//
// A block of 8 warps owns a 128-row query tile of one head; each warp owns 16
// of its rows and keeps, in registers, their Q fragments, the 16 x 64 score
// tile of the current key tile and the 16 x 64 output accumulator. Key and
// value tiles of 64 rows stream through two shared-memory buffers (cp.async
// fills the next while the tensor cores work on this one) up to the
// diagonal; only the two key tiles the diagonal crosses need the causal mask.
// 128 query rows a block (rather than 64) halve the K/V traffic from L2.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "models/cuda/flash_attention_mma.cuh"

namespace estuary::models::cuda {

namespace {

using namespace flash;

constexpr int kForwardWarps = 8;
constexpr int kForwardThreads = 32 * kForwardWarps;
constexpr int kQueryRows = 16 * kForwardWarps;  // a query tile: two key tiles
static_assert(kQueryRows == 2 * kTile, "the mask and the tile count assume two key tiles per query tile");
constexpr int kBufferElems = 2 * kTileElems;  // one K and V pair
constexpr size_t kForwardSmem = (kQueryRows * kHeadDim + 2 * kBufferElems) * 2;  // Q; K, V twice: 48 KB

template <typename T>
__global__ void __launch_bounds__(kForwardThreads) FlashForwardKernel(const T* qkv, Shape s, T* out, float* lse) {
  extern __shared__ __align__(128) unsigned char smem[];
  // Q, then (K, V) for even tiles and (K, V) for odd ones. Buffers are
  // found by arithmetic, not through an array of pointers, which would be
  // indexed at run time and so live in local memory.
  T* q_tile = reinterpret_cast<T*>(smem);
  T* k_tiles = q_tile + kQueryRows * kHeadDim;  // buffer i: k_tiles + i * kBufferElems
  T* v_tiles = k_tiles + kTileElems;

  // The last query tiles see the most key tiles: start them first.
  const int query_tile = int(gridDim.x) - 1 - int(blockIdx.x);
  const int q0 = query_tile * kQueryRows;
  const int b = blockIdx.y / s.heads, h = blockIdx.y % s.heads, g = h / (s.heads / s.kv_heads);
  const T* base = qkv + int64_t(b) * s.seq * s.width;
  const int64_t k_column = int64_t(s.heads + g) * kHeadDim, v_column = int64_t(s.heads + s.kv_heads + g) * kHeadDim;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);

  LoadTileAsync<T, kQueryRows, kForwardThreads>(base, s.width, int64_t(h) * kHeadDim, q0, s.seq, q_tile);
  LoadTileAsync<T, kTile, kForwardThreads>(base, s.width, k_column, 0, s.seq, k_tiles);
  LoadTileAsync<T, kTile, kForwardThreads>(base, s.width, v_column, 0, s.seq, v_tiles);
  CommitCopies();

  uint32_t q_frag[4][4];
  float acc[8][4];
  Zero(acc);
  // Per thread: rows quad_row and quad_row + 8 of the warp's 16. The running
  // maximum is of the scores scaled by scale * log2(e) (exp2 replaces exp);
  // the running sums are this thread's columns only, summed over the quad
  // at the end (every lane of a quad rescales by the same factor).
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};
  const float scale_log2 = s.scale * kLog2e;

  // Key tiles up to the diagonal, and none wholly past seq.
  const int tiles = min(2 * query_tile + 2, (s.seq + kTile - 1) / kTile);
  const int warp_last_row = q0 + 16 * warp + 15;
  for (int t = 0; t < tiles; ++t) {
    const int k0 = t * kTile;
    WaitForCopies();
    __syncthreads();  // tile t has landed, and every warp is done with tile t - 1's buffers
    if (t + 1 < tiles) {
      T* next_k = k_tiles + ((t + 1) & 1) * kBufferElems;
      T* next_v = v_tiles + ((t + 1) & 1) * kBufferElems;
      LoadTileAsync<T, kTile, kForwardThreads>(base, s.width, k_column, k0 + kTile, s.seq, next_k);
      LoadTileAsync<T, kTile, kForwardThreads>(base, s.width, v_column, k0 + kTile, s.seq, next_v);
    }
    CommitCopies();
    if (t == 0) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) LoadA(q_frag[kk], q_tile, 16 * warp, 16 * kk);
    }
    // Every key of this tile is past the warp's rows (the upper half of the
    // last tile for the warps of the tile's first 64 rows): nothing to add.
    if (k0 > warp_last_row) continue;
    const T* k_tile = k_tiles + (t & 1) * kBufferElems;
    const T* v_tile = v_tiles + (t & 1) * kBufferElems;

    float scores[8][4];
    Zero(scores);
    MmaTransposedTile<T>(scores, q_frag, k_tile);
    if (k0 + kTile > q0) {
      // A tile the diagonal crosses: key k0 + c is masked past row q0 + r.
      // Keys past seq only occur in these, past every real row. A row may
      // be wholly masked here, but never before its first tile: key 0 is
      // in every row, so its running maximum is finite by then.
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 16 * warp + quad_row + (e >= 2 ? 8 : 0), c = 8 * j + quad_col + (e & 1);
          if (k0 + c > q0 + r) scores[j][e] = -INFINITY;
        }
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) tile_max = fmaxf(tile_max, fmaxf(scores[j][2 * half], scores[j][2 * half + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float new_max = fmaxf(row_max[half], tile_max * scale_log2);
      // Guards the (unreachable) fully masked row against inf - inf.
      const float shift = new_max == -INFINITY ? 0.0f : new_max;
      const float alpha = Exp2(row_max[half] - shift);
      row_max[half] = new_max;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          scores[j][e] = Exp2(scores[j][e] * scale_log2 - shift);
          sum += scores[j][e];
          acc[j][e] *= alpha;
        }
      }
      row_sum[half] = row_sum[half] * alpha + sum;
    }
    // acc += P V, P rounded to T straight from the score registers.
    MmaFromAccumulators<T>(acc, scores, v_tile);
  }

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = row_sum[half];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int qi = q0 + 16 * warp + quad_row + 8 * half;
    if (qi >= s.seq) continue;
    const float inv = 1.0f / sum;
    T* dst = out + (int64_t(b) * s.seq + qi) * s.out_width + int64_t(h) * kHeadDim + quad_col;
#pragma unroll
    for (int j = 0; j < 8; ++j) StorePair(dst + 8 * j, acc[j][2 * half] * inv, acc[j][2 * half + 1] * inv);
    // Natural log, as the header promises: row_max is in log2 units.
    if (lane % 4 == 0) lse[(int64_t(b) * s.heads + h) * s.seq + qi] = row_max[half] * float(M_LN2) + logf(sum);
  }
}

// Raises a kernel's dynamic shared-memory limit (needed above 48 KB; set
// always, so that changing a tile size cannot forget it).
template <typename Kernel>
cudaError_t AllowSmem(Kernel kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

template <typename T>
cudaError_t Forward(const void* qkv, int batch, int seq, int heads, int kv_heads, void* out, float* lse,
                    cudaStream_t stream) {
  static const cudaError_t allowed = AllowSmem(FlashForwardKernel<T>, kForwardSmem);
  if (allowed != cudaSuccess) return allowed;
  const dim3 grid((seq + kQueryRows - 1) / kQueryRows, batch * heads);
  FlashForwardKernel<T><<<grid, kForwardThreads, kForwardSmem, stream>>>(
      static_cast<const T*>(qkv), MakeShape(seq, heads, kv_heads), static_cast<T*>(out), lse);
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

}  // namespace internal

}  // namespace estuary::models::cuda
