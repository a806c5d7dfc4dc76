// ClassifierEngine: the MNIST models of models/model.h ("mlp", "cnn") trained
// on one GPU (a cuda::Engine, models/cuda/engine.h).
//
// Same names, shapes, order and offsets as models::MakeModel(name)'s manifest,
// so the flat fp32 parameter buffer copies one to one between the CPU model
// and the engine (weights, checkpoints, federated updates). The fp32 master
// parameters and fp32 gradients live on the device. Every activation comes
// from one buffer sized at Create for max_batch examples, so no step, forward
// or evaluation allocates device memory.
//
// Layers are the ops of models/cuda/layers.h with cuBLAS products. A Conv2d
// unfolds the whole batch with one Im2Col and runs each product as a single
// strided-batched GEMM over the images (the weight shared, stride 0): one
// launch per product instead of one per image. The weight gradient is formed
// per image by that batched GEMM and summed over the batch in a fixed order
// (image 0 first, as models::Conv2d accumulates), so runs are deterministic.
//
// Precision: f32 (fp32 GEMMs; TF32 only if asked), or bf16: the GEMMs read a
// bf16 working copy of the weights and bf16 copies of their activation
// inputs and accumulate into fp32 outputs; biases, ReLU, pooling, softmax,
// loss and every gradient stay fp32. The working copy is written by
// CopyParametersFrom/Initialize and by Step (the optimizer's fused
// WorkingCopy output). f16 is refused: it would need loss scaling.
//
//   ESTUARY_ASSIGN_OR_RETURN(auto engine, ClassifierEngine::Create("cnn", 10));
//   ESTUARY_RETURN_IF_ERROR(engine.Initialize(seed));
//   ESTUARY_ASSIGN_OR_RETURN(auto sgd, cuda::Sgd::Create(engine.parameter_count(), 0.05f, 0.9f, 0));
//   ESTUARY_ASSIGN_OR_RETURN(float loss, engine.ForwardBackward(x, y, n));
//   ESTUARY_RETURN_IF_ERROR(engine.Step(sgd));
//
// Inputs are host arrays: x [n, 784] fp32, y [n] labels in [0, 10), checked
// on the host before anything is enqueued. They are copied through a pinned
// staging buffer; before refilling it the host waits only for the previous
// upload (the first operation of the previous call), never for its compute.
// All work is enqueued on the engine's stream. Not thread-safe: one thread
// drives an engine.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "models/cuda/engine.h"
#include "models/cuda/optimizer.h"
#include "models/model.h"
#include "models/step_hooks.h"
#include "models/tensor.h"

namespace estuary::models::cuda {

struct ClassifierEngineOptions {
  DType precision = DType::kF32;  // f32 or bf16
  // f32 only: let cuBLAS round GEMM inputs to TF32 (faster, ~1e-3 relative).
  bool allow_tf32 = false;
  // Run on this stream (the caller's, kept alive by it) instead of the
  // engine's own: a data-parallel rank hands it to its NCCL communicator too.
  cudaStream_t stream = nullptr;
};

// Beyond Engine: manifest() equals models::MakeModel(name())'s and units()
// are its layers; Initialize draws with the CPU model itself
// (models::Model::Initialize(seed)'s bits); CopyParametersFrom also waits for
// the copy. Step does not clip (max_grad_norm > 0 is refused) and never skips.
class ClassifierEngine : public Engine {
 public:
  // `model` is "mlp" or "cnn"; max_batch bounds n in every call. The
  // parameters start at zero: Initialize or CopyParametersFrom first.
  static Result<ClassifierEngine> Create(std::string_view model, int max_batch,
                                         ClassifierEngineOptions options = {});

  ClassifierEngine(ClassifierEngine&&) noexcept = default;
  ClassifierEngine& operator=(ClassifierEngine&&) noexcept = default;

  std::string_view name() const;
  int input_size() const { return 784; }
  int num_classes() const { return 10; }
  int max_batch() const;
  size_t activation_bytes() const;  // the activation buffer allocated at Create

  Status Initialize(uint64_t seed) override;

  // Forward, mean softmax cross-entropy over the n examples, backward:
  // overwrites gradients() and leaves the loss in device memory, no wait.
  Status ForwardBackwardAsync(const float* x, const int32_t* y, int n);
  // With data-parallel options (models/step_hooks.h): the gradient of
  // options.grad_scale × the mean loss, and options.hooks->GradientsFinal
  // called as each layer's backward is enqueued (on stream(), which a
  // communicator following it orders its collectives after). BeforeUnit and
  // AfterUnit are not called, and accumulate is refused.
  Status ForwardBackwardAsync(const float* x, const int32_t* y, int n, const BackwardOptions& options);
  // The same, then waits for the loss.
  Result<float> ForwardBackward(const float* x, const int32_t* y, int n);

  // Writes logits [n, 10] to host memory (waits).
  Status Forward(const float* x, int n, float* logits);
  // Mean loss and accuracy over n examples in batches of max_batch, as
  // models::Evaluate (argmax ties to the first class).
  Result<EvalResult> Evaluate(const float* x, const int32_t* y, uint64_t n);

  // Engine::Step without clipping, as a Status: a classifier's step always
  // runs. (Through an Engine&, Step(optimizer) is the same step.)
  Status Step(Sgd& optimizer);
  Status Step(AdamW& optimizer);

 private:
  struct Impl;
  explicit ClassifierEngine(std::unique_ptr<Impl> impl);
  Impl& impl() const;
};

}  // namespace estuary::models::cuda
