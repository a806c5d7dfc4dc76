// Kernels of cuda::ClassifierEngine beyond the shared layer ops.
#include "models/cuda/classifier_kernels.h"
#include "models/cuda/kernels.h"

namespace estuary::models::cuda::internal {
namespace {

// One thread per output, grid-striding; consecutive threads read consecutive
// floats of each image's slice, so every load is coalesced.
__global__ void SumOverBatchKernel(const float* partials, int64_t n, int64_t count, float* out) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < count; j += stride) {
    float sum = partials[j];
    for (int64_t i = 1; i < n; ++i) sum += partials[i * count + j];
    out[j] = sum;
  }
}

}  // namespace

cudaError_t SumOverBatch(const float* partials, int64_t n, int64_t count, float* out, cudaStream_t s) {
  if (n <= 0 || count <= 0) return cudaSuccess;
  int64_t blocks = (count + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  SumOverBatchKernel<<<unsigned(blocks), kThreads, 0, s>>>(partials, n, count, out);
  return cudaGetLastError();
}

}  // namespace estuary::models::cuda::internal
