#include "models/cuda/flash_attention.h"

#include <cstdint>

#include "models/cuda/check.h"

namespace estuary::models::cuda {

namespace internal {
int FlashAttentionHeadDim();
cudaError_t FlashAttentionForward(bool bf16, const void* qkv, int batch, int seq, int heads, int kv_heads, void* out,
                                  float* lse, cudaStream_t stream);
cudaError_t FlashAttentionBackward(bool bf16, const void* qkv, const void* out, const void* dout, const float* lse,
                                   int batch, int seq, int heads, int kv_heads, float* delta, void* dqkv,
                                   cudaStream_t stream);
}  // namespace internal

namespace {

Status Check(const char* what, DType dtype, int batch, int seq, int heads, int kv_heads, int head_dim) {
  if (!FlashAttentionSupports(dtype, head_dim)) {
    return InvalidArgument("{}: {} with head_dim {} is not compiled (bf16 or f16, head_dim {})", what,
                           DTypeName(dtype), head_dim, internal::FlashAttentionHeadDim());
  }
  if (batch < 1 || seq < 1 || heads < 1 || kv_heads < 1 || heads % kv_heads != 0) {
    return InvalidArgument("{}: batch={} seq={} heads={} kv_heads={}: every size must be positive and kv_heads "
                           "divide heads",
                           what, batch, seq, heads, kv_heads);
  }
  // Grids put batch x heads in their second dimension; the delta kernel counts rows in an int.
  if (int64_t(batch) * heads > 65535 || int64_t(batch) * seq * heads > INT32_MAX) {
    return InvalidArgument("{}: batch={} seq={} heads={} is more than the kernels' grids take", what, batch, seq,
                           heads);
  }
  return Status::Ok();
}

}  // namespace

bool FlashAttentionSupports(DType dtype, int head_dim) {
  return (dtype == DType::kBF16 || dtype == DType::kF16) && head_dim == internal::FlashAttentionHeadDim();
}

Status FlashAttentionForward(DType dtype, const void* qkv, int batch, int seq, int heads, int kv_heads,
                             int head_dim, void* out, float* lse, cudaStream_t stream) {
  ESTUARY_RETURN_IF_ERROR(Check("cuda flash attention", dtype, batch, seq, heads, kv_heads, head_dim));
  if (!qkv || !out || !lse) return InvalidArgument("cuda flash attention: null buffer");
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::FlashAttentionForward(dtype == DType::kBF16, qkv, batch, seq, heads,
                                                               kv_heads, out, lse, stream));
  return Status::Ok();
}

Status FlashAttentionBackward(DType dtype, const void* qkv, const void* out, const void* dout, const float* lse,
                              int batch, int seq, int heads, int kv_heads, int head_dim, float* delta, void* dqkv,
                              cudaStream_t stream) {
  ESTUARY_RETURN_IF_ERROR(Check("cuda flash attention backward", dtype, batch, seq, heads, kv_heads, head_dim));
  if (!qkv || !out || !dout || !lse || !delta || !dqkv) {
    return InvalidArgument("cuda flash attention backward: null buffer");
  }
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::FlashAttentionBackward(dtype == DType::kBF16, qkv, out, dout, lse, batch,
                                                                seq, heads, kv_heads, delta, dqkv, stream));
  return Status::Ok();
}

}  // namespace estuary::models::cuda
