// The one kernel the NCCL engine needs: kAverage divides the sum by size()
// after NCCL's sum (ncclAvg would scale each input first, which rounds
// differently from the Gloo engine's sum-then-divide). Plain CUDA types only:
// nvcc cannot compile fmt, so nothing here includes base/status.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace estuary::comm::internal {

// x[i] /= divisor for i < n, enqueued on stream; returns the launch's error.
cudaError_t DivideInPlace(float* x, size_t n, float divisor, cudaStream_t stream);
cudaError_t DivideInPlace(double* x, size_t n, double divisor, cudaStream_t stream);

}  // namespace estuary::comm::internal
