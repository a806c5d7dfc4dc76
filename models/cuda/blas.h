// Matrix products on the GPU through cuBLAS, with row-major semantics.
//
// Gemm(blas, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
// computes C = alpha * op(A) * op(B) + beta * C exactly as
// cblas_sgemm(CblasRowMajor, ...) does with the same arguments (models/layers.cc
// ports one to one): op(A) is m x k, op(B) is k x n, C is m x n, all row-major
// with leading dimensions lda, ldb, ldc. A and B share one dtype (fp32, bf16 or
// fp16); C is fp32 or that dtype; accumulation is always fp32. TF32 tensor
// cores are used only when GemmTypes::allow_tf32 says so (fp32 inputs only),
// since they round the inputs to 10 mantissa bits.
//
// GemmStridedBatched runs `batch` such products at once, matrix i of each
// operand starting stride_a/stride_b/stride_c elements after matrix i-1: for
// attention, one product per sequence with the operands read in place from
// the fused qkv buffer (a leading dimension wider than the matrix). Output
// matrices must not overlap: stride_c >= (m - 1) * ldc + n when batch > 1.
//
// A Blas is a cuBLAS handle bound to one stream with a workspace of its own,
// so a GEMM never allocates device memory behind the caller's back.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "base/status.h"
#include "models/cuda/device.h"
#include "models/tensor.h"

namespace estuary::models::cuda {

class Blas {
 public:
  static constexpr size_t kDefaultWorkspaceBytes = size_t(32) << 20;

  Blas() = default;
  static Result<Blas> Create(cudaStream_t stream, size_t workspace_bytes = kDefaultWorkspaceBytes);
  ~Blas();
  Blas(Blas&& other) noexcept;
  Blas& operator=(Blas&& other) noexcept;
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  cublasHandle_t handle() const { return handle_; }
  cudaStream_t stream() const { return stream_; }

 private:
  cublasHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  DeviceBuffer workspace_;
};

struct GemmTypes {
  DType inputs = DType::kF32;  // A and B
  DType output = DType::kF32;  // C: fp32 or the inputs' dtype
  bool allow_tf32 = false;
};

Status Gemm(const Blas& blas, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
            const void* a, int64_t lda, const void* b, int64_t ldb, float beta, void* c, int64_t ldc,
            GemmTypes types = {});

Status GemmStridedBatched(const Blas& blas, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                          float alpha, const void* a, int64_t lda, int64_t stride_a, const void* b, int64_t ldb,
                          int64_t stride_b, float beta, void* c, int64_t ldc, int64_t stride_c, int64_t batch,
                          GemmTypes types = {});

}  // namespace estuary::models::cuda
