// Kernels of the decoder's embedding (transformer_kernels.h): the lookup, and
// its backward without atomics: the positions are stably sorted by token
// (CUB's radix sort), then one block per distinct token sums its run in
// ascending position, the CPU's order, so results repeat bit for bit.
#include <cmath>
#include <cub/device/device_radix_sort.cuh>

#include "models/cuda/kernel_common.cuh"
#include "models/cuda/transformer_kernels.h"

namespace estuary::models::cuda::internal {
namespace {

size_t Round256(size_t bytes) { return (bytes + 255) / 256 * 256; }

template <int N, typename T>
__global__ void __launch_bounds__(kThreads) EmbeddingForwardKernel(const int32_t* tokens, int64_t total,
                                                                   const T* table, int vocab, int dim,
                                                                   float* out) {
  for (int64_t q = FirstIndex(); q < total / N; q += Stride()) {
    const int64_t i = q * N, row = i / dim, col = i - row * dim;
    const int32_t token = tokens[row];
    float v[N];
    if (token >= 0 && token < vocab) {
      Load<N>(table + int64_t(token) * dim + col, v);
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) v[j] = NAN;
    }
    Store<N>(out + i, v);
  }
}

__global__ void IotaKernel(int32_t* values, int n) {
  for (int64_t i = FirstIndex(); i < n; i += Stride()) values[i] = int32_t(i);
}

// keys: the tokens sorted (stably); positions: where each came from. Block
// per run head; a run's positions ascend, so the sum has the CPU's order.
__global__ void __launch_bounds__(kThreads) EmbeddingBackwardKernel(const int32_t* keys, const int32_t* positions,
                                                                    int n, const float* dout, int vocab, int dim,
                                                                    float* dtable) {
  for (int s = blockIdx.x; s < n; s += gridDim.x) {
    const int32_t token = keys[s];
    if ((s > 0 && keys[s - 1] == token) || token < 0 || token >= vocab) continue;  // not a run head, or invalid
    float* row = dtable + int64_t(token) * dim;
    for (int col = threadIdx.x; col < dim; col += blockDim.x) {
      float sum = row[col];
      for (int t = s; t < n && keys[t] == token; ++t) sum += dout[int64_t(positions[t]) * dim + col];
      row[col] = sum;
    }
  }
}

}  // namespace

cudaError_t EmbeddingForward(const int32_t* tokens, int n, const void* table, Kind table_kind, int vocab, int dim,
                             float* out, bool vec, cudaStream_t s) {
  const int64_t total = int64_t(n) * dim;
  if (total <= 0) return cudaSuccess;
  return Dispatch(table_kind, [&](auto tag) {
    using T = decltype(tag);
    const T* rows = static_cast<const T*>(table);
    if (vec) {
      EmbeddingForwardKernel<4, T><<<unsigned(Blocks(total / 4)), kThreads, 0, s>>>(tokens, total, rows, vocab, dim,
                                                                                     out);
    } else {
      EmbeddingForwardKernel<1, T><<<unsigned(Blocks(total)), kThreads, 0, s>>>(tokens, total, rows, vocab, dim, out);
    }
    return cudaGetLastError();
  });
}

cudaError_t EmbeddingBackwardScratchBytes(int n, size_t* bytes) {
  size_t sort_bytes = 0;
  const cudaError_t e = cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const int32_t*>(nullptr),
                                                        static_cast<int32_t*>(nullptr),
                                                        static_cast<const int32_t*>(nullptr),
                                                        static_cast<int32_t*>(nullptr), n);
  if (e != cudaSuccess) return e;
  *bytes = 3 * Round256(size_t(n) * sizeof(int32_t)) + Round256(sort_bytes);
  return cudaSuccess;
}

cudaError_t EmbeddingBackward(const int32_t* tokens, int n, const float* dout, int vocab, int dim, float* dtable,
                              void* scratch, size_t scratch_bytes, cudaStream_t s) {
  if (n <= 0 || dim <= 0) return cudaSuccess;
  size_t needed = 0;
  if (const cudaError_t e = EmbeddingBackwardScratchBytes(n, &needed); e != cudaSuccess) return e;
  if (scratch_bytes < needed) return cudaErrorInvalidValue;
  char* base = static_cast<char*>(scratch);
  const size_t ints = Round256(size_t(n) * sizeof(int32_t));
  auto* positions_in = reinterpret_cast<int32_t*>(base);
  auto* keys = reinterpret_cast<int32_t*>(base + ints);
  auto* positions = reinterpret_cast<int32_t*>(base + 2 * ints);
  void* sort_scratch = base + 3 * ints;
  size_t sort_bytes = scratch_bytes - 3 * ints;
  IotaKernel<<<unsigned(Blocks(n)), kThreads, 0, s>>>(positions_in, n);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  // Radix sort is stable: equal tokens keep ascending positions.
  if (const cudaError_t e = cub::DeviceRadixSort::SortPairs(sort_scratch, sort_bytes, tokens, keys, positions_in,
                                                            positions, n, 0, int(sizeof(int32_t) * 8), s);
      e != cudaSuccess) {
    return e;
  }
  const int64_t blocks = n < kMaxBlocks ? n : kMaxBlocks;
  EmbeddingBackwardKernel<<<unsigned(blocks), kThreads, 0, s>>>(keys, positions, n, dout, vocab, dim, dtable);
  return cudaGetLastError();
}

}  // namespace estuary::models::cuda::internal
