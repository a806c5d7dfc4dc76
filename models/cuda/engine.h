// Engine: what the GPU training engines have in common — cuda::LlamaEngine,
// cuda::ClassifierEngine and cuda::LoraLlamaEngine — so that a caller can
// hold any of them through one type, and that what they share is written once.
//
// An engine trains one flat fp32 buffer on one GPU: parameters() and
// gradients() are device buffers of parameter_count() floats laid out as
// manifest() says, and units() split it for DDP and ZeRO
// (models/step_hooks.h). Under bf16/f16 the GEMMs read a low-precision working
// copy of the parameters (working_parameters()), which CopyParametersFrom,
// RefreshWorkingCopy and Step write. What an engine trains on (tokens, images)
// is its own: the forward and backward calls are the concrete engines', and
// each leaves its mean loss in device_loss().
//
//   cuda::Engine& engine = lora;  // or a LlamaEngine, a ClassifierEngine
//   ESTUARY_RETURN_IF_ERROR(engine.CopyParametersFrom(global));
//   ... the engine's own ForwardBackwardAsync ...
//   ESTUARY_ASSIGN_OR_RETURN(const float loss, engine.ReadLoss());
//   ESTUARY_ASSIGN_OR_RETURN(const bool stepped, engine.Step(adamw));
//
// All work is enqueued on stream(); the calls that hand data to the host
// (CopyParametersTo, CopyGradientsTo, ReadLoss) wait for it. Sizes are
// checked, and errors name the engine ("cuda llama: ..."). Engines move,
// never copy. Not thread-safe: one thread drives an engine.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "base/status.h"
#include "models/cuda/optimizer.h"
#include "models/step_hooks.h"
#include "models/tensor.h"

namespace estuary::models::cuda {

struct EngineState;  // models/cuda/engine_state.h

class Engine {
 public:
  virtual ~Engine();

  const Manifest& manifest() const;
  int64_t parameter_count() const;
  std::vector<ParameterUnit> units() const;
  DType precision() const;
  cudaStream_t stream() const;

  // Device buffers of parameter_count() floats in manifest order (null where
  // an engine has none: see LlamaEngine's frozen base).
  float* parameters();
  float* gradients();
  // The bf16/f16 copy of the parameters the GEMMs read; null under f32.
  const void* working_parameters() const;
  // Device bytes holding the weights: the fp32 parameters and the working copy.
  size_t parameter_bytes() const;

  // The engine's initial weights for `seed`: the same bits as its CPU twin's.
  virtual Status Initialize(uint64_t seed) = 0;
  // Host <-> device copies of the whole buffer (sizes checked). From
  // refreshes the working copy; To waits for the stream.
  Status CopyParametersFrom(std::span<const float> host);
  Status CopyParametersTo(std::span<float> host);
  Status CopyGradientsTo(std::span<float> host);
  // Rewrites the working copy from parameters() after something other than
  // Step changed them on the device (a ZeRO all-gather); nothing to do under
  // f32.
  Status RefreshWorkingCopy();

  // The mean loss of the last forward-backward, on the device; ReadLoss
  // waits for it.
  const float* device_loss() const;
  Result<float> ReadLoss();

  // One optimizer step over the whole buffer (optimizer.size() must be
  // parameter_count()), also writing the working copy. With max_grad_norm > 0
  // the gradients are first clipped to it (clip_grad_norm_). Returns false
  // when the step was skipped (an f16 step with inf/NaN gradients).
  Result<bool> Step(AdamW& optimizer, double max_grad_norm = 0);
  Result<bool> Step(Sgd& optimizer, double max_grad_norm = 0);

 protected:
  explicit Engine(std::unique_ptr<EngineState> state);
  Engine(Engine&&) noexcept;
  Engine& operator=(Engine&&) noexcept;
  // The concrete engine's Impl, which derives from EngineState.
  EngineState& state() const;

 private:
  template <typename Optimizer>
  Result<bool> StepWith(Optimizer& optimizer, double max_grad_norm);
  std::unique_ptr<EngineState> state_;
};

}  // namespace estuary::models::cuda
