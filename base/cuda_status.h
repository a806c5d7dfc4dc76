// CUDA runtime errors as Status, for every library that drives a GPU (the
// models' engines, the NCCL communicator, the data-parallel buffer work).
//
//   ESTUARY_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, stream));
//
// returns, from the enclosing function, an internal-error Status whose message
// names where and what failed: "models/cuda/device.cc:57: cudaMalloc(&ptr, bytes)
// failed: cudaErrorMemoryAllocation (out of memory)". Nothing aborts; the
// caller decides. Include it only where the CUDA runtime's headers are.
#pragma once

#include <cuda_runtime_api.h>

#include "base/status.h"

namespace estuary {

inline Status CudaError(cudaError_t error, const char* call, const char* file, int line) {
  // The failed call left the error as the thread's "last error"; clearing it
  // keeps a later launch check from reporting this one again. Sticky errors
  // (a faulted context) cannot be cleared and will keep surfacing, as they should.
  (void)cudaGetLastError();
  return Internal("{}:{}: {} failed: {} ({})", file, line, call, cudaGetErrorName(error),
                  cudaGetErrorString(error));
}

}  // namespace estuary

#define ESTUARY_CUDA_RETURN_IF_ERROR(call)                                                   \
  do {                                                                                       \
    const cudaError_t estuary_cuda_error_ = (call);                                          \
    if (estuary_cuda_error_ != cudaSuccess)                                                  \
      return ::estuary::CudaError(estuary_cuda_error_, #call, __FILE__, __LINE__);           \
  } while (0)
