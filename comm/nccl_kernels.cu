#include "comm/nccl_kernels.h"

namespace estuary::comm::internal {
namespace {

constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = 4096;

template <typename T>
__global__ void Divide(T* x, size_t n, T divisor) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    x[i] /= divisor;
  }
}

template <typename T>
cudaError_t Launch(T* x, size_t n, T divisor, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  size_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  Divide<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, n, divisor);
  return cudaGetLastError();
}

}  // namespace

cudaError_t DivideInPlace(float* x, size_t n, float divisor, cudaStream_t stream) {
  return Launch(x, n, divisor, stream);
}
cudaError_t DivideInPlace(double* x, size_t n, double divisor, cudaStream_t stream) {
  return Launch(x, n, divisor, stream);
}

}  // namespace estuary::comm::internal
