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

#define ESTUARY_CUDA_RETURN_IF_ERROR(call) \
  ESTUARY_CUDA_RETURN_IF_FAILED_(cudaError_t, cudaSuccess, CudaError, call, #call)
#define ESTUARY_CUBLAS_RETURN_IF_ERROR(call) \
  ESTUARY_CUDA_RETURN_IF_FAILED_(cublasStatus_t, CUBLAS_STATUS_SUCCESS, CublasError, call, #call)

// What both share: `call` returns a `type` that is `ok` on success, and
// `to_status` turns any other into the Status returned; `text` is the call as
// written, stringized before its arguments' macros expand.
#define ESTUARY_CUDA_RETURN_IF_FAILED_(type, ok, to_status, call, text)                   \
  do {                                                                                     \
    const type estuary_cuda_result_ = (call);                                              \
    if (estuary_cuda_result_ != ok)                                                        \
      return ::estuary::models::cuda::to_status(estuary_cuda_result_, text, __FILE__, __LINE__); \
  } while (0)
