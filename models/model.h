// Model: a network whose parameters live in one flat fp32 buffer.
//
// parameters() and gradients() are views of the flat buffers (same layout,
// described by manifest()), never copies. A training step is
//   loss = model.ForwardBackward(x, y, n);   // fills gradients(), mean loss over n
//   optimizer.Step(model.parameters(), model.gradients());
// Parameter layout follows PyTorch (Linear weight is [out, in], Conv2d weight
// is [out_channels, in_channels, kh, kw]) so tensors map one to one onto a
// torch state_dict with the same names.
//
// For DDP and ZeRO (models/step_hooks.h): units() cuts the buffer into one
// unit per layer ("fc1", "conv2", ...), and ForwardBackward takes
// BackwardOptions (accumulation, gradient scale, hooks). Both buffers are
// page-aligned mmap memory (models/flat_buffer.h).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "models/step_hooks.h"
#include "models/tensor.h"

namespace estuary::models {

struct EvalResult {
  double loss = 0;       // mean softmax cross-entropy
  double accuracy = 0;   // fraction of argmax == label
  uint64_t examples = 0;
};

class Model {
 public:
  virtual ~Model() = default;

  virtual std::string_view name() const = 0;   // "mlp", "cnn"
  virtual const Manifest& manifest() const = 0;
  virtual std::span<float> parameters() = 0;
  virtual std::span<const float> parameters() const = 0;
  virtual std::span<float> gradients() = 0;
  // One unit per layer (its weight and bias), tiling the buffer in order.
  virtual std::vector<ParameterUnit> units() const = 0;
  // Input features per example (784 for MNIST) and number of classes.
  virtual int input_size() const = 0;
  virtual int num_classes() const = 0;

  // PyTorch's default init (uniform ±1/sqrt(fan_in) for weights and biases),
  // drawn from a generator seeded with `seed`: same seed, same bits.
  virtual void Initialize(uint64_t seed) = 0;

  // Forward, softmax cross-entropy (mean over the batch) and backward.
  // Overwrites gradients() (or adds, see BackwardOptions); returns the mean
  // loss. x is [n, input_size], y is [n].
  virtual float ForwardBackward(const float* x, const int32_t* y, int n, const BackwardOptions& options) = 0;
  float ForwardBackward(const float* x, const int32_t* y, int n) { return ForwardBackward(x, y, n, {}); }

  // One step of plain SGD (no momentum), as ForwardBackward followed by
  // Sgd(lr, 0, weight_decay).Step, but with the update fused into each
  // layer's weight-gradient product: the large gradients are never written
  // and read back. gradients() is not filled, so no hooks: a single-process
  // path, not one for DDP or ZeRO. Returns the mean loss.
  virtual float TrainStepSgd(const float* x, const int32_t* y, int n, float lr, float weight_decay) = 0;

  // Forward only: writes logits [n, num_classes].
  virtual void Forward(const float* x, int n, float* logits) = 0;
};

// "mlp" (784-200-200-10, McMahan et al.'s 2NN) or "cnn" (McMahan's CNN).
Result<std::unique_ptr<Model>> MakeModel(std::string_view name);

// Mean loss and accuracy of `model` over n examples, in batches. The default
// batch is the one the classifiers' kernels suit (kEvalBatch): their forward
// then runs on libxsmm as a training step's does, and a batch's activations
// stay in cache (the CNN's unfolded inputs at batch 500 would take 300 MB).
inline constexpr int kEvalBatch = 32;
EvalResult Evaluate(Model& model, const float* x, const int32_t* y, uint64_t n, int batch = kEvalBatch);

// The same with `params` loaded into each replica and the examples split into
// one contiguous slice per replica, each on its own thread. Slices are
// combined in order, so the result does not depend on thread timing, and
// they are cut at multiples of kEvalBatch, so every batch holds the same
// examples whatever the number of replicas: a kernel's sums can depend on
// the batch it runs (libxsmm's for the last layer do), and the accuracy
// must not depend on the threads.
EvalResult EvaluateParallel(std::vector<std::unique_ptr<Model>>& replicas, std::span<const float> params,
                            const float* x, const int32_t* y, uint64_t n);

}  // namespace estuary::models
