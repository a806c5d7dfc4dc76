#include "models/cuda/blas.h"

#include <algorithm>
#include <climits>
#include <utility>

#include "models/cuda/check.h"

namespace estuary::models::cuda {

Result<Blas> Blas::Create(cudaStream_t stream, size_t workspace_bytes) {
  Blas blas;
  blas.stream_ = stream;
  ESTUARY_ASSIGN_OR_RETURN(blas.workspace_, DeviceBuffer::Allocate(workspace_bytes));
  ESTUARY_CUBLAS_RETURN_IF_ERROR(cublasCreate(&blas.handle_));
  // cublasSetStream resets the workspace to cuBLAS's own pool, so the stream goes first.
  ESTUARY_CUBLAS_RETURN_IF_ERROR(cublasSetStream(blas.handle_, stream));
  ESTUARY_CUBLAS_RETURN_IF_ERROR(
      cublasSetWorkspace(blas.handle_, blas.workspace_.data(), blas.workspace_.size()));
  // alpha and beta come from the host; no TF32 unless a call asks for it.
  ESTUARY_CUBLAS_RETURN_IF_ERROR(cublasSetPointerMode(blas.handle_, CUBLAS_POINTER_MODE_HOST));
  ESTUARY_CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(blas.handle_, CUBLAS_DEFAULT_MATH));
  return blas;
}

Blas::~Blas() {
  if (handle_) (void)cublasDestroy(handle_);
}

Blas::Blas(Blas&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)),
      stream_(std::exchange(other.stream_, nullptr)),
      workspace_(std::move(other.workspace_)) {}

Blas& Blas::operator=(Blas&& other) noexcept {
  if (this != &other) {
    if (handle_) (void)cublasDestroy(handle_);
    handle_ = std::exchange(other.handle_, nullptr);
    stream_ = std::exchange(other.stream_, nullptr);
    workspace_ = std::move(other.workspace_);
  }
  return *this;
}

namespace {

cudaDataType_t CudaType(DType dtype) {
  switch (dtype) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

}  // namespace

namespace {

// The checks Gemm and GemmStridedBatched share; `what` names the caller.
Status CheckGemm(const char* what, const Blas& blas, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                 int64_t lda, int64_t ldb, int64_t ldc, GemmTypes types) {
  if (!blas.handle()) return FailedPrecondition("{}: the Blas handle is empty (moved from?)", what);
  if (m < 0 || n < 0 || k < 0 || m > INT_MAX || n > INT_MAX || k > INT_MAX) {
    return InvalidArgument("{}: dimensions m={} n={} k={} must lie in [0, {}]", what, m, n, k, INT_MAX);
  }
  // Row-major: a stored row holds k elements of op(A) (m when transposed), and so on.
  const int64_t min_lda = std::max<int64_t>(1, trans_a ? m : k), min_ldb = std::max<int64_t>(1, trans_b ? k : n),
                min_ldc = std::max<int64_t>(1, n);
  if (lda < min_lda || ldb < min_ldb || ldc < min_ldc || lda > INT_MAX || ldb > INT_MAX || ldc > INT_MAX) {
    return InvalidArgument("{}: leading dimensions lda={} ldb={} ldc={} must be at least {}, {}, {} and fit "
                           "an int", what, lda, ldb, ldc, min_lda, min_ldb, min_ldc);
  }
  if (types.output != DType::kF32 && types.output != types.inputs) {
    return InvalidArgument("{}: output dtype {} with {} inputs; it must be f32 or the inputs' dtype", what,
                           DTypeName(types.output), DTypeName(types.inputs));
  }
  if (types.allow_tf32 && types.inputs != DType::kF32) {
    return InvalidArgument("{}: TF32 applies to f32 inputs, not {}", what, DTypeName(types.inputs));
  }
  return Status::Ok();
}

}  // namespace

Status Gemm(const Blas& blas, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
            const void* a, int64_t lda, const void* b, int64_t ldb, float beta, void* c, int64_t ldc,
            GemmTypes types) {
  ESTUARY_RETURN_IF_ERROR(CheckGemm("cuda gemm", blas, trans_a, trans_b, m, n, k, lda, ldb, ldc, types));
  if (m == 0 || n == 0) return Status::Ok();
  if (!c || (k > 0 && (!a || !b))) return InvalidArgument("cuda gemm: null operand (a={} b={} c={})", a, b, c);

  const cublasComputeType_t compute = types.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  // Column-major cuBLAS sees each row-major matrix transposed: C^T = op(B)^T op(A)^T,
  // so B goes first, with the same transpose flags, and the roles of m and n swap.
  ESTUARY_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(
      blas.handle(), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, int(n), int(m),
      int(k), &alpha, b, CudaType(types.inputs), int(ldb), a, CudaType(types.inputs), int(lda), &beta, c,
      CudaType(types.output), int(ldc), compute, CUBLAS_GEMM_DEFAULT));
  return Status::Ok();
}

Status GemmStridedBatched(const Blas& blas, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                          float alpha, const void* a, int64_t lda, int64_t stride_a, const void* b, int64_t ldb,
                          int64_t stride_b, float beta, void* c, int64_t ldc, int64_t stride_c, int64_t batch,
                          GemmTypes types) {
  ESTUARY_RETURN_IF_ERROR(
      CheckGemm("cuda batched gemm", blas, trans_a, trans_b, m, n, k, lda, ldb, ldc, types));
  if (batch < 0 || batch > INT_MAX || stride_a < 0 || stride_b < 0 || stride_c < 0) {
    return InvalidArgument("cuda batched gemm: batch {} must lie in [0, {}] and strides ({}, {}, {}) be non-negative",
                           batch, INT_MAX, stride_a, stride_b, stride_c);
  }
  // Batches of C may not overlap (cuBLAS would race); A and B may be shared (stride 0).
  const int64_t c_rows_span = (m - 1) * ldc + n;
  if (batch > 1 && m > 0 && n > 0 && stride_c < c_rows_span) {
    return InvalidArgument("cuda batched gemm: stride_c {} makes the {} output matrices of {}x{} (ldc {}) overlap",
                           stride_c, batch, m, n, ldc);
  }
  if (m == 0 || n == 0 || batch == 0) return Status::Ok();
  if (!c || (k > 0 && (!a || !b))) {
    return InvalidArgument("cuda batched gemm: null operand (a={} b={} c={})", a, b, c);
  }
  const cublasComputeType_t compute = types.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  ESTUARY_CUBLAS_RETURN_IF_ERROR(cublasGemmStridedBatchedEx(
      blas.handle(), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, int(n), int(m),
      int(k), &alpha, b, CudaType(types.inputs), int(ldb), stride_b, a, CudaType(types.inputs), int(lda), stride_a,
      &beta, c, CudaType(types.output), int(ldc), stride_c, int(batch), compute, CUBLAS_GEMM_DEFAULT));
  return Status::Ok();
}

}  // namespace estuary::models::cuda
