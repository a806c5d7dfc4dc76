#include "models/cuda/precision.h"

#include "models/cuda/check.h"
#include "models/cuda/device.h"
#include "models/cuda/kernels.h"

namespace estuary::models::cuda {

static_assert(int(internal::Kind::kF32) == int(DType::kF32) && int(internal::Kind::kBF16) == int(DType::kBF16) &&
              int(internal::Kind::kF16) == int(DType::kF16));

Status Convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t count, cudaStream_t stream) {
  if (count < 0) return InvalidArgument("cuda convert: negative count {}", count);
  const bool narrowing = src_dtype == DType::kF32 && dst_dtype != DType::kF32;
  const bool widening = dst_dtype == DType::kF32 && src_dtype != DType::kF32;
  if (!narrowing && !widening) {
    return InvalidArgument("cuda convert: {} -> {} is not a conversion (f32 <-> bf16/f16)", DTypeName(src_dtype),
                           DTypeName(dst_dtype));
  }
  if (count == 0) return Status::Ok();
  if (!src || !dst) return InvalidArgument("cuda convert: null buffer (src={} dst={})", src, dst);
  // Four fp32 are 16 bytes and four 16-bit values 8: what one vector access moves.
  const auto align = [](DType t) { return t == DType::kF32 ? 16u : 8u; };
  const bool vec = internal::IsAligned(src, align(src_dtype)) && internal::IsAligned(dst, align(dst_dtype));
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::Convert(src, internal::Kind(src_dtype), dst, internal::Kind(dst_dtype),
                                                 count, vec, stream));
  return Status::Ok();
}

Status UnscaleAndCheckFinite(float* grads, int64_t count, float inv_scale, float* found_inf, cudaStream_t stream) {
  if (count < 0) return InvalidArgument("cuda unscale: negative count {}", count);
  if (!found_inf || (count > 0 && !grads)) {
    return InvalidArgument("cuda unscale: null buffer (grads={} found_inf={})", static_cast<void*>(grads),
                           static_cast<void*>(found_inf));
  }
  ESTUARY_RETURN_IF_ERROR(FillBytes(found_inf, 0, sizeof(float), stream));
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::UnscaleAndCheck(grads, count, inv_scale, found_inf,
                                                         internal::IsAligned(grads, 16), stream));
  return Status::Ok();
}

Result<bool> ReadFoundInf(const float* found_inf, cudaStream_t stream) {
  if (!found_inf) return InvalidArgument("cuda found-inf flag: null pointer");
  float flag = 0;
  ESTUARY_RETURN_IF_ERROR(CopyToHost(&flag, found_inf, sizeof flag, stream));
  return flag != 0.0f;
}

}  // namespace estuary::models::cuda
