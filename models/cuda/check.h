// CUDA runtime and cuBLAS errors as Status.
//
//   ESTUARY_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, stream));
//   ESTUARY_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(...));
//
// return, from the enclosing function, an internal-error Status whose message
// names where and what failed: "models/cuda/device.cc:57: cudaMalloc(&ptr, bytes)
// failed: cudaErrorMemoryAllocation (out of memory)". Nothing aborts; the
// caller decides. Kernel launches are checked the same way: every launcher in
// models/cuda returns cudaGetLastError() right after its launch.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "base/status.h"

namespace estuary::models::cuda {

inline Status CudaError(cudaError_t error, const char* call, const char* file, int line) {
  // The failed call left the error as the thread's "last error"; clearing it
  // keeps a later launch check from reporting this one again. Sticky errors
  // (a faulted context) cannot be cleared and will keep surfacing, as they should.
  (void)cudaGetLastError();
  return Internal("{}:{}: {} failed: {} ({})", file, line, call, cudaGetErrorName(error),
                  cudaGetErrorString(error));
}

inline Status CublasError(cublasStatus_t status, const char* call, const char* file, int line) {
  return Internal("{}:{}: {} failed: {} ({})", file, line, call, cublasGetStatusName(status),
                  cublasGetStatusString(status));
}

}  // namespace estuary::models::cuda

#define ESTUARY_CUDA_RETURN_IF_ERROR(call)                                                   \
  do {                                                                                       \
    const cudaError_t estuary_cuda_error_ = (call);                                          \
    if (estuary_cuda_error_ != cudaSuccess)                                                  \
      return ::estuary::models::cuda::CudaError(estuary_cuda_error_, #call, __FILE__, __LINE__); \
  } while (0)

#define ESTUARY_CUBLAS_RETURN_IF_ERROR(call)                                                      \
  do {                                                                                            \
    const cublasStatus_t estuary_cublas_status_ = (call);                                         \
    if (estuary_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                          \
      return ::estuary::models::cuda::CublasError(estuary_cublas_status_, #call, __FILE__, __LINE__); \
  } while (0)
