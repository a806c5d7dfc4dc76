// EngineState: what every GPU engine holds behind its cuda::Engine
// (models/cuda/engine.h), and where the engines differ (internal to the
// engines' .cc files).
//
// Each engine's Impl derives from it, fills it in at Create (the manifest and
// units, the precision, the stream, the flat buffers, where the loss lands,
// what clipping may use) and overrides the hooks below where it differs from
// the plain case. Engine's shared methods work on it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "models/cuda/device.h"
#include "models/step_hooks.h"
#include "models/tensor.h"

namespace estuary::models::cuda {

struct EngineState {
  virtual ~EngineState() = default;

  // How errors name the engine: "cuda llama", "cuda classifier mlp", ...
  std::string who;
  // The buffer holds LoRA adapters: errors speak of "adapter parameters" that
  // "the adapters have" rather than parameters "the model has".
  bool adapters = false;

  Manifest manifest;  // of the flat buffer
  std::vector<ParameterUnit> units;
  DType precision = DType::kF32;
  // Where all work is enqueued: the caller's stream, owned_stream, or the
  // base engine's (LoRA).
  cudaStream_t stream = nullptr;
  Stream owned_stream;
  // The fp32 parameters (the master), fp32 gradients, and under bf16/f16 the
  // working copy. An engine may leave params or grads empty (a frozen base).
  DeviceBuffer params, grads, working;
  // The device float a forward-backward leaves its mean loss in.
  const float* loss = nullptr;
  // Step's clipping: a device double for the norm and ClipGradNorm's scratch.
  // Null where an engine does not clip.
  double* clip_norm = nullptr;
  Arena* clip_scratch = nullptr;

  // The dtype of the GEMMs' inputs and of the activations kept for backward.
  DType act() const { return precision; }
  bool low() const { return precision != DType::kF32; }
  cudaStream_t s() const { return stream; }
  int64_t count() const { return int64_t(manifest.total_elements); }
  float* P() const { return params.as<float>(); }
  float* G() const { return grads.as<float>(); }
  // What the GEMMs read: the parameters under f32, else the working copy.
  const void* W(uint64_t offset) const {
    return low() ? static_cast<const void*>(working.as<char>() + offset * DTypeSize(precision))
                 : static_cast<const void*>(P() + offset);
  }

  // Works on `given`, or on a stream of its own when given is null.
  Status UseStream(cudaStream_t given);
  // The flat buffers for manifest, zeroed: the parameters, the gradients
  // (with_gradients), and the working copy under bf16/f16.
  Status AllocateFlat(bool with_gradients);
  // What every engine refuses of BackwardOptions: accumulate (each step
  // overwrites the gradients), and a grad_scale that is not finite and >= 0.
  Status CheckBackwardOptions(const BackwardOptions& options) const;

  // -------- where engines differ
  // Host values (their count checked) into the parameters and the working
  // copy, and the parameters back to the host (waiting for the stream).
  virtual Status UploadParameters(std::span<const float> host);
  virtual Status DownloadParameters(std::span<float> host);
  virtual size_t ParameterBytes() const { return params.size() + working.size(); }
  // Ok, or why Step (CopyGradientsTo) is refused outright.
  virtual Status CanStep() const { return Status::Ok(); }
  virtual Status HasGradients() const { return Status::Ok(); }
  // Before an update: false when this step is to be skipped.
  virtual Result<bool> UnscaleGradients() { return true; }
};

}  // namespace estuary::models::cuda
