#include "models/cuda/engine.h"

#include <fmt/format.h>

#include <cmath>
#include <utility>

#include "models/cuda/engine_state.h"
#include "models/cuda/precision.h"

namespace estuary::models::cuda {
namespace {

// How the messages below name the buffer's owner.
std::string_view OwnerHas(const EngineState& m) { return m.adapters ? "the adapters have" : "the model has"; }

// Ok when `given` host values (`what`: parameters, gradients) match the
// buffer; `room` says the host is the destination.
Status CheckHostSize(const EngineState& m, size_t given, bool room, std::string_view what) {
  if (given == m.manifest.total_elements) return Status::Ok();
  return InvalidArgument("{}: {}{} {}{} given, {} {}", m.who, room ? "room for " : "", given,
                         m.adapters ? "adapter " : "", what, OwnerHas(m), m.manifest.total_elements);
}

}  // namespace

// ------------------------------------------------------------- EngineState

Status EngineState::UseStream(cudaStream_t given) {
  if (!given) {
    ESTUARY_ASSIGN_OR_RETURN(owned_stream, Stream::Create());
    given = owned_stream.get();
  }
  stream = given;
  return Status::Ok();
}

Status EngineState::AllocateFlat(bool with_gradients) {
  const size_t elements = manifest.total_elements;
  ESTUARY_ASSIGN_OR_RETURN(params, DeviceBuffer::Allocate(elements * sizeof(float)));
  ESTUARY_RETURN_IF_ERROR(FillBytes(params.data(), 0, params.size(), s()));
  if (with_gradients) {
    ESTUARY_ASSIGN_OR_RETURN(grads, DeviceBuffer::Allocate(elements * sizeof(float)));
    ESTUARY_RETURN_IF_ERROR(FillBytes(grads.data(), 0, grads.size(), s()));
  }
  if (low()) {
    ESTUARY_ASSIGN_OR_RETURN(working, DeviceBuffer::Allocate(elements * DTypeSize(precision)));
    ESTUARY_RETURN_IF_ERROR(FillBytes(working.data(), 0, working.size(), s()));
  }
  return Status::Ok();
}

Status EngineState::CheckBackwardOptions(const BackwardOptions& options) const {
  if (options.accumulate) {
    return InvalidArgument("{}: gradient accumulation (BackwardOptions.accumulate) is not supported; "
                           "every step overwrites the gradients",
                           who);
  }
  if (!(options.grad_scale >= 0) || !std::isfinite(options.grad_scale)) {
    return InvalidArgument("{}: grad_scale {} must be finite and >= 0", who, options.grad_scale);
  }
  return Status::Ok();
}

Status EngineState::UploadParameters(std::span<const float> host) {
  ESTUARY_RETURN_IF_ERROR(CopyToDevice(P(), host.data(), host.size_bytes(), s()));
  if (low()) ESTUARY_RETURN_IF_ERROR(Convert(P(), DType::kF32, working.data(), precision, count(), s()));
  return Status::Ok();
}

Status EngineState::DownloadParameters(std::span<float> host) {
  return CopyToHost(host.data(), P(), host.size_bytes(), s());
}

// ------------------------------------------------------------------ Engine

Engine::Engine(std::unique_ptr<EngineState> state) : state_(std::move(state)) {}
Engine::Engine(Engine&&) noexcept = default;
Engine& Engine::operator=(Engine&&) noexcept = default;
Engine::~Engine() = default;
EngineState& Engine::state() const { return *state_; }

const Manifest& Engine::manifest() const { return state_->manifest; }
int64_t Engine::parameter_count() const { return state_->count(); }
std::vector<ParameterUnit> Engine::units() const { return state_->units; }
DType Engine::precision() const { return state_->precision; }
cudaStream_t Engine::stream() const { return state_->s(); }
float* Engine::parameters() { return state_->P(); }
float* Engine::gradients() { return state_->G(); }
const void* Engine::working_parameters() const { return state_->low() ? state_->working.data() : nullptr; }
size_t Engine::parameter_bytes() const { return state_->ParameterBytes(); }
const float* Engine::device_loss() const { return state_->loss; }

Status Engine::CopyParametersFrom(std::span<const float> host) {
  ESTUARY_RETURN_IF_ERROR(CheckHostSize(*state_, host.size(), /*room=*/false, "parameters"));
  return state_->UploadParameters(host);
}

Status Engine::CopyParametersTo(std::span<float> host) {
  ESTUARY_RETURN_IF_ERROR(CheckHostSize(*state_, host.size(), /*room=*/true, "parameters"));
  return state_->DownloadParameters(host);
}

Status Engine::CopyGradientsTo(std::span<float> host) {
  ESTUARY_RETURN_IF_ERROR(state_->HasGradients());
  ESTUARY_RETURN_IF_ERROR(CheckHostSize(*state_, host.size(), /*room=*/true, "gradients"));
  return CopyToHost(host.data(), state_->G(), host.size_bytes(), state_->s());
}

Status Engine::RefreshWorkingCopy() {
  const EngineState& m = *state_;
  // Without parameters (a dropped master) the working copy is the weights.
  if (!m.low() || !m.P()) return Status::Ok();
  return Convert(m.P(), DType::kF32, m.working.data(), m.precision, m.count(), m.s());
}

Result<float> Engine::ReadLoss() {
  float loss = 0;
  ESTUARY_RETURN_IF_ERROR(CopyToHost(&loss, state_->loss, sizeof loss, state_->s()));
  return loss;
}

template <typename Optimizer>
Result<bool> Engine::StepWith(Optimizer& optimizer, double max_grad_norm) {
  EngineState& m = *state_;
  ESTUARY_RETURN_IF_ERROR(m.CanStep());
  if (optimizer.size() != m.count()) {
    return InvalidArgument("{}: the optimizer holds state for {} parameters, {} {}", m.who, optimizer.size(),
                           OwnerHas(m), m.count());
  }
  if (!(max_grad_norm >= 0) || !std::isfinite(max_grad_norm)) {
    return InvalidArgument("{}: max_grad_norm {} must be finite and >= 0 (0: no clipping)", m.who, max_grad_norm);
  }
  if (max_grad_norm > 0 && !m.clip_scratch) {
    return InvalidArgument("{}: gradient clipping (max_grad_norm {}) is not supported", m.who, max_grad_norm);
  }
  ESTUARY_ASSIGN_OR_RETURN(const bool update, m.UnscaleGradients());
  if (!update) return false;
  if (max_grad_norm > 0) {
    m.clip_scratch->Reset();  // safe: every user of the scratch is on this stream, in order
    ESTUARY_RETURN_IF_ERROR(ClipGradNorm(m.G(), m.count(), max_grad_norm, m.clip_norm, *m.clip_scratch, m.s()));
  }
  WorkingCopy working;
  if (m.low()) working = {m.working.data(), m.precision};
  ESTUARY_RETURN_IF_ERROR(optimizer.Step(m.P(), m.G(), m.s(), working));
  return true;
}

Result<bool> Engine::Step(AdamW& optimizer, double max_grad_norm) { return StepWith(optimizer, max_grad_norm); }
Result<bool> Engine::Step(Sgd& optimizer, double max_grad_norm) { return StepWith(optimizer, max_grad_norm); }

}  // namespace estuary::models::cuda
