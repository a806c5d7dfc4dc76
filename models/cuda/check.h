// cuBLAS errors as Status, beside the CUDA runtime's (base/cuda_status.h).
//
//   ESTUARY_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(...));
//
// returns, from the enclosing function, an internal-error Status naming where
// and what failed, as ESTUARY_CUDA_RETURN_IF_ERROR does. Nothing aborts; the
// caller decides. Kernel launches are checked the same way: every launcher in
// models/cuda returns cudaGetLastError() right after its launch.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "base/cuda_status.h"
#include "base/status.h"

namespace estuary::models::cuda {

inline Status CublasError(cublasStatus_t status, const char* call, const char* file, int line) {
  return Internal("{}:{}: {} failed: {} ({})", file, line, call, cublasGetStatusName(status),
                  cublasGetStatusString(status));
}

}  // namespace estuary::models::cuda

#define ESTUARY_CUBLAS_RETURN_IF_ERROR(call)                                                      \
  do {                                                                                            \
    const cublasStatus_t estuary_cublas_status_ = (call);                                         \
    if (estuary_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                          \
      return ::estuary::models::cuda::CublasError(estuary_cublas_status_, #call, __FILE__, __LINE__); \
  } while (0)
