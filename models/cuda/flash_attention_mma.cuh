// What the flash-attention kernels share (internal; included by
// flash_attention_forward.cu and flash_attention_backward.cu only): tile
// sizes, the swizzled shared-memory layout of a 64 x 64 tile, cp.async copies
// into it, ldmatrix loads of mma.sync fragments out of it, and the mma itself.
//
// Fragment layouts are those of mma.sync.aligned.m16n8k16.row.col with fp32
// accumulators (PTX ISA, "Matrix Fragments for mma.m16n8k16"): with
// g = lane / 4 and c = lane % 4, a thread holds
//   A (16 x 16): a[0] row g cols 2c, 2c+1; a[1] row g+8 cols 2c, 2c+1;
//                a[2] row g cols 2c+8, 2c+9; a[3] row g+8 cols 2c+8, 2c+9
//   B (16 x 8):  b[0] rows 2c, 2c+1 col g; b[1] rows 2c+8, 2c+9 col g
//   C (16 x 8):  c[0], c[1] row g cols 2c, 2c+1; c[2], c[3] row g+8 cols 2c, 2c+1
// so two adjacent C tiles (columns 0-7 and 8-15), rounded and packed in
// pairs, are exactly an A fragment: a probability tile computed as C feeds
// the next product as A without leaving registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace estuary::models::cuda::flash {

constexpr int kHeadDim = 64;  // the one head size compiled
constexpr int kTile = 64;     // key rows per tile; query rows too, except in the forward
constexpr int kWarps = 4;     // each warp owns 16 rows of a tile (the backward's blocks)
constexpr int kThreads = kWarps * 32;
constexpr int kTileElems = kTile * kHeadDim;  // one 16-bit tile, unpadded
constexpr float kLog2e = 1.4426950408889634f;
static_assert(kTile == 16 * kWarps, "a warp owns 16 rows of a tile");
static_assert(kHeadDim == 64, "the swizzle assumes 128-byte rows (8 chunks of 16 bytes)");

// Element offset of (row, col) in a tile stored as 64 rows of 128 bytes whose
// eight 16-byte chunks are permuted by row % 8: the eight rows an ldmatrix
// phase reads at one logical chunk then fall in eight different bank groups,
// and so do the eight chunks of a row that cp.async writes.
__device__ __forceinline__ int Swizzle(int row, int col) {
  return row * kHeadDim + ((((col >> 3) ^ row) & 7) << 3) + (col & 7);
}

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; zeros when !valid.
__device__ __forceinline__ void CopyAsync16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SharedAddress(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
// 4 bytes global -> shared, asynchronously; zero when !valid.
__device__ __forceinline__ void CopyAsync4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(SharedAddress(dst)), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void CommitCopies() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void WaitForCopies() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Starts copying rows [row0, row0 + kRows) of one head (kHeadDim columns at
// `column`) of a [n, width] matrix into a swizzled tile, with a block of
// kBlockThreads threads; rows at or past `rows` become zeros (their source
// address stays inside the first row).
template <typename T, int kRows = kTile, int kBlockThreads = kThreads>
__device__ __forceinline__ void LoadTileAsync(const T* base, int64_t width, int64_t column, int row0, int rows,
                                              T* tile) {
  constexpr int kChunks = kHeadDim * int(sizeof(T)) / 16;  // per row
  static_assert(kRows * kChunks % kBlockThreads == 0, "every thread copies as many chunks");
#pragma unroll
  for (int step = 0; step < kRows * kChunks / kBlockThreads; ++step) {
    const int i = step * kBlockThreads + int(threadIdx.x);
    const int r = i / kChunks, chunk = i % kChunks;
    const bool valid = row0 + r < rows;
    const T* src = base + (valid ? int64_t(row0 + r) * width : int64_t(0)) + column + chunk * 8;
    CopyAsync16(tile + Swizzle(r, chunk * 8), src, valid);
  }
}

// ldmatrix: four 8 x 8 matrices of 16-bit elements; lane l gives the address
// of row l % 8 of matrix l / 8.
__device__ __forceinline__ void LoadMatrices(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(p)));
}
__device__ __forceinline__ void LoadMatricesTransposed(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(p)));
}

// The A fragment of rows [row0, row0 + 16) x cols [col0, col0 + 16) of a tile.
template <typename T>
__device__ __forceinline__ void LoadA(uint32_t (&a)[4], const T* tile, int row0, int col0) {
  const int lane = threadIdx.x % 32;
  LoadMatrices(a, tile + Swizzle(row0 + (lane & 15), col0 + (lane >> 4) * 8));
}

// B fragments of B[k][n] = tile[n][k] (the tile transposed: Kᵀ, Qᵀ, dOᵀ,
// Vᵀ) for k in [k0, k0 + 16): b[0], b[1] for n in [n0, n0 + 8) and b[2],
// b[3] for n in [n0 + 8, n0 + 16).
template <typename T>
__device__ __forceinline__ void LoadBOfTransposed(uint32_t (&b)[4], const T* tile, int n0, int k0) {
  const int lane = threadIdx.x % 32;
  LoadMatrices(b, tile + Swizzle(n0 + (lane & 7) + ((lane >> 4) << 3), k0 + ((lane >> 3) & 1) * 8));
}

// B fragments of B[k][n] = tile[k][n] (V, dO, Q, K as stored), same order.
template <typename T>
__device__ __forceinline__ void LoadB(uint32_t (&b)[4], const T* tile, int k0, int n0) {
  const int lane = threadIdx.x % 32;
  LoadMatricesTransposed(b, tile + Swizzle(k0 + (lane & 7) + ((lane >> 3) & 1) * 8, n0 + (lane >> 4) * 8));
}

// c += a · b over one 16 x 8 x 16 step, fp32 accumulation.
template <typename T>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<T, __half>, "bf16 or fp16");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats rounded (nearest even) to T and packed, the first in the low half.
template <typename T>
__device__ __forceinline__ uint32_t Pack(float lo, float hi) {
  uint32_t packed;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    packed = *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    packed = *reinterpret_cast<const uint32_t*>(&v);
  }
  return packed;
}

// The A fragment for k-slice kk (columns 16 kk .. 16 kk + 15) of a 16 x 64
// tile held as eight C fragments (see the top of this file).
template <typename T>
__device__ __forceinline__ void CToA(uint32_t (&a)[4], const float (&c)[8][4], int kk) {
  a[0] = Pack<T>(c[2 * kk][0], c[2 * kk][1]);
  a[1] = Pack<T>(c[2 * kk][2], c[2 * kk][3]);
  a[2] = Pack<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = Pack<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// acc[16 x 64] (+)= A[16 x 64] · B where `a` holds A's four k-slices and
// B[k][n] = tile[n][k] (the tile's rows are B's columns).
template <typename T>
__device__ __forceinline__ void MmaTransposedTile(float (&acc)[8][4], const uint32_t (&a)[4][4], const T* tile) {
#pragma unroll
  for (int np = 0; np < 4; ++np) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t b[4];
      LoadBOfTransposed(b, tile, 16 * np, 16 * kk);
      Mma<T>(acc[2 * np], a[kk], b[0], b[1]);
      Mma<T>(acc[2 * np + 1], a[kk], b[2], b[3]);
    }
  }
}

// acc[16 x 64] += C-tile · B where the 16 x 64 left operand is held as eight
// C fragments (rounded to T here) and B[k][n] = tile[k][n].
template <typename T>
__device__ __forceinline__ void MmaFromAccumulators(float (&acc)[8][4], const float (&left)[8][4], const T* tile) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t a[4];
    CToA<T>(a, left, kk);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t b[4];
      LoadB(b, tile, 16 * kk, 16 * np);
      Mma<T>(acc[2 * np], a, b[0], b[1]);
      Mma<T>(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

__device__ __forceinline__ void Zero(float (&acc)[8][4]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
}

// 2^x; 2^-inf = 0.
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Stores v[0..1] as two adjacent T (4-byte aligned).
template <typename T>
__device__ __forceinline__ void StorePair(T* dst, float lo, float hi) {
  *reinterpret_cast<uint32_t*>(dst) = Pack<T>(lo, hi);
}

struct Shape {
  int seq, heads, kv_heads;
  int64_t width, out_width;  // elements per row of qkv and of out
  float scale;               // 1 / sqrt(head_dim)
};

inline Shape MakeShape(int seq, int heads, int kv_heads) {
  return {seq,
          heads,
          kv_heads,
          int64_t(heads + 2 * kv_heads) * kHeadDim,
          int64_t(heads) * kHeadDim,
          0.125f /* 1 / sqrt(64) */};
}
static_assert(kHeadDim == 64, "MakeShape's scale is 1 / sqrt(64)");

}  // namespace estuary::models::cuda::flash
