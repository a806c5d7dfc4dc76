#include "models/cuda/optimizer.h"

#include <cmath>

#include "models/cuda/check.h"
#include "models/cuda/kernels.h"

namespace estuary::models::cuda {
namespace {

Status CheckWorkingCopy(const char* what, WorkingCopy working) {
  if (working.data && working.dtype == DType::kF32) {
    return InvalidArgument("{}: the working copy must be bf16 or f16, not f32", what);
  }
  return Status::Ok();
}

internal::Kind WorkingKind(WorkingCopy working) {
  return working.data ? internal::Kind(working.dtype) : internal::Kind::kNone;
}

// Every flat buffer 16-byte aligned (four floats), the working copy 8 (four halves).
bool Vectorisable(std::initializer_list<const void*> floats, const void* working) {
  for (const void* p : floats) {
    if (p && !internal::IsAligned(p, 16)) return false;
  }
  return !working || internal::IsAligned(working, 8);
}

// The slices hold `count` elements in all, none of them null.
Status CheckSlices(const char* what, std::span<const ParameterSlice> slices, int64_t count) {
  if (int64_t(SliceElements(slices)) != count) {
    return InvalidArgument("{}: slices of {} elements, the optimizer holds state for {}", what,
                           SliceElements(slices), count);
  }
  for (const ParameterSlice& s : slices) {
    if (s.size > 0 && (!s.params || !s.grads)) {
      return InvalidArgument("{}: null buffer (params={} grads={})", what, static_cast<void*>(s.params),
                             static_cast<const void*>(s.grads));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<AdamW> AdamW::Create(int64_t count, AdamWOptions options, cudaStream_t stream) {
  if (count < 0 || uint64_t(count) > SIZE_MAX / (2 * sizeof(float))) {
    return InvalidArgument("cuda AdamW: cannot hold {} parameters", count);
  }
  AdamW adamw;
  adamw.options_ = options;
  adamw.count_ = count;
  ESTUARY_ASSIGN_OR_RETURN(adamw.moments_, DeviceBuffer::Allocate(size_t(count) * 2 * sizeof(float)));
  ESTUARY_RETURN_IF_ERROR(FillBytes(adamw.moments_.data(), 0, adamw.moments_.size(), stream));
  return adamw;
}

Status AdamW::Step(float* params, const float* grads, cudaStream_t stream, WorkingCopy working) {
  ESTUARY_RETURN_IF_ERROR(CheckWorkingCopy("cuda AdamW", working));
  const ParameterSlice whole{params, grads, size_t(count_)};
  return StepSlices(std::span<const ParameterSlice>(&whole, 1), working, stream);
}

Status AdamW::Step(std::span<const ParameterSlice> slices, cudaStream_t stream) {
  return StepSlices(slices, {}, stream);
}

Status AdamW::StepSlices(std::span<const ParameterSlice> slices, WorkingCopy working, cudaStream_t stream) {
  ESTUARY_RETURN_IF_ERROR(CheckSlices("cuda AdamW", slices, count_));
  const int64_t t = step_ + 1;
  const AdamWOptions& o = options_;
  // The scalars exactly as models::AdamW forms them: corrections in double, the rest in float.
  const double c1 = 1.0 - std::pow(double(o.beta1), double(t));
  const double c2 = 1.0 - std::pow(double(o.beta2), double(t));
  internal::AdamWArgs args{};
  args.beta1 = o.beta1;
  args.beta2 = o.beta2;
  args.one_minus_beta1 = 1.0f - o.beta1;
  args.one_minus_beta2 = 1.0f - o.beta2;
  args.eps = o.eps;
  args.decay = 1.0f - o.lr * o.weight_decay;
  args.step_size = float(o.lr / c1);
  args.bias_correction2_sqrt = float(std::sqrt(c2));
  float* m = moments_.as<float>();
  float* v = m ? m + count_ : nullptr;
  for (const ParameterSlice& s : slices) {
    const bool vec = Vectorisable({s.params, s.grads, m, v}, working.data);
    ESTUARY_CUDA_RETURN_IF_ERROR(internal::AdamWStep(s.params, s.grads, m, v, int64_t(s.size), args, working.data,
                                                     WorkingKind(working), vec, stream));
    m += s.size;
    v += s.size;
  }
  step_ = t;
  return Status::Ok();
}

Status AdamW::SaveState(std::span<float> first, std::span<float> second, cudaStream_t stream) const {
  if (int64_t(first.size()) != count_ || int64_t(second.size()) != count_) {
    return InvalidArgument("cuda AdamW: state of {} parameters, room for {} and {} given", count_, first.size(),
                           second.size());
  }
  ESTUARY_RETURN_IF_ERROR(CopyToHost(first.data(), first_moment(), first.size_bytes(), stream));
  return CopyToHost(second.data(), second_moment(), second.size_bytes(), stream);
}

Status AdamW::LoadState(std::span<const float> first, std::span<const float> second, int64_t step_count,
                        cudaStream_t stream) {
  if (int64_t(first.size()) != count_ || int64_t(second.size()) != count_ || step_count < 0) {
    return InvalidArgument("cuda AdamW: state of {} parameters, {} and {} given at step {}", count_, first.size(),
                           second.size(), step_count);
  }
  ESTUARY_RETURN_IF_ERROR(CopyToDevice(moments_.as<float>(), first.data(), first.size_bytes(), stream));
  ESTUARY_RETURN_IF_ERROR(CopyToDevice(moments_.as<float>() + count_, second.data(), second.size_bytes(), stream));
  step_ = step_count;
  return Status::Ok();
}

Result<Sgd> Sgd::Create(int64_t count, float lr, float momentum, float weight_decay) {
  if (count < 0 || uint64_t(count) > SIZE_MAX / sizeof(float)) {
    return InvalidArgument("cuda SGD: cannot hold {} parameters", count);
  }
  Sgd sgd;
  sgd.lr_ = lr;
  sgd.momentum_ = momentum;
  sgd.weight_decay_ = weight_decay;
  sgd.count_ = count;
  // The first step writes the whole buffer, so it needs no zeroing.
  if (momentum != 0.0f) {
    ESTUARY_ASSIGN_OR_RETURN(sgd.buffer_, DeviceBuffer::Allocate(size_t(count) * sizeof(float)));
  }
  return sgd;
}

Status Sgd::Step(float* params, const float* grads, cudaStream_t stream, WorkingCopy working) {
  ESTUARY_RETURN_IF_ERROR(CheckWorkingCopy("cuda SGD", working));
  const ParameterSlice whole{params, grads, size_t(count_)};
  return StepSlices(std::span<const ParameterSlice>(&whole, 1), working, stream);
}

Status Sgd::Step(std::span<const ParameterSlice> slices, cudaStream_t stream) { return StepSlices(slices, {}, stream); }

Status Sgd::StepSlices(std::span<const ParameterSlice> slices, WorkingCopy working, cudaStream_t stream) {
  ESTUARY_RETURN_IF_ERROR(CheckSlices("cuda SGD", slices, count_));
  float* buffer = buffer_.as<float>();
  for (const ParameterSlice& s : slices) {
    const bool vec = Vectorisable({s.params, s.grads, buffer}, working.data);
    ESTUARY_CUDA_RETURN_IF_ERROR(internal::SgdStep(s.params, s.grads, buffer, int64_t(s.size), lr_, momentum_,
                                                   weight_decay_, first_, working.data, WorkingKind(working), vec,
                                                   stream));
    if (buffer) buffer += s.size;
  }
  first_ = false;
  return Status::Ok();
}

Status ClipGradNorm(float* grads, int64_t count, double max_norm, double* norm, Arena& arena, cudaStream_t stream) {
  if (count < 0) return InvalidArgument("cuda clip_grad_norm: negative count {}", count);
  if (!norm || (count > 0 && !grads)) {
    return InvalidArgument("cuda clip_grad_norm: null buffer (grads={} norm={})", static_cast<void*>(grads),
                           static_cast<void*>(norm));
  }
  ESTUARY_ASSIGN_OR_RETURN(double* partials, arena.Allocate<double>(internal::kNormBlocks));
  ESTUARY_ASSIGN_OR_RETURN(float* coef, arena.Allocate<float>(1));
  const bool vec = internal::IsAligned(grads, 16);
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::SquaredNormPartials(grads, count, partials, vec, stream));
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::ClipCoefficient(partials, max_norm, norm, coef, stream));
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::ScaleByDeviceScalar(grads, count, coef, vec, stream));
  return Status::Ok();
}

}  // namespace estuary::models::cuda
