// What a training step tells the data-parallel engine above it (DDP, ZeRO).
//
// DDP and ZeRO (client/) are written once over the models' flat buffers; a
// model meets them at three points, all grouped in BackwardOptions:
//
// - Units. units() cuts the flat parameter buffer into ParameterUnits:
//   contiguous [begin, end) ranges that tile it in buffer order (a layer of
//   the MLP or CNN; the embedding, each block, the final norm with an untied
//   LM head, for Llama). A step calls BeforeUnit(u) before it reads any
//   parameter of unit u and AfterUnit(u) after its last read in that stretch;
//   no parameter is read outside such a bracket, and brackets never overlap
//   (at most one unit is open at a time). So ZeRO-3 can gather a unit's
//   shards in BeforeUnit and drop them in AfterUnit.
//   Forward opens every unit in order (a tied embedding a second time, for
//   the LM head, last). Backward opens, in the reverse of that order, every
//   unit whose backward reads its parameters: not the embedding lookup, nor a
//   first layer (no input gradient, so only its weight gradient is formed).
//   Backward's first unit is forward's last, so an engine may keep it across
//   the turn.
// - Gradient readiness. During backward, GradientsFinal(offset) says that
//   every gradient at flat offset >= offset holds its final value for this
//   step (accumulation included) and will not be written again: a bucket's
//   all-reduce or reduce-scatter may start. Offsets strictly decrease and the
//   last call is 0, after which backward writes no gradient.
// - Accumulation and scaling. With accumulate, backward adds this step's
//   gradients into the buffer instead of overwriting it (micro-batches); the
//   gradient formed is that of grad_scale × mean loss (1/k over k
//   micro-batches, or a loss scale). The loss returned is the plain mean.
//
// Hooks run on the training thread, synchronously, and cannot stop a pass:
// an engine whose collective fails keeps the first Status and reports it
// after the step (the communicator fails every later call at once anyway).
// Without hooks, and with accumulate = false and grad_scale = 1, a step is
// the plain single-process step, bit for bit.
#pragma once

#include <cstdint>
#include <string>

namespace estuary::models {

// A contiguous range of the flat parameter buffer, in elements; the gradient
// of the unit is the same range of the gradient buffer.
struct ParameterUnit {
  std::string name;  // "fc1", "model.layers.3", ...
  uint64_t begin = 0, end = 0;
};

enum class Pass { kForward, kBackward };

// Every method does nothing by default; an engine overrides what it needs.
class StepHooks {
 public:
  virtual ~StepHooks() = default;
  virtual void BeforeUnit(int /*unit*/, Pass /*pass*/) {}
  virtual void AfterUnit(int /*unit*/, Pass /*pass*/) {}
  virtual void GradientsFinal(uint64_t /*offset*/) {}

  // The hooks to call when a step was given none: all no-ops.
  static StepHooks& None() {
    static StepHooks none;
    return none;
  }
};

struct BackwardOptions {
  bool accumulate = false;  // add into gradients() instead of overwriting them
  float grad_scale = 1.0f;  // form the gradient of grad_scale × mean loss
  StepHooks* hooks = nullptr;
};

}  // namespace estuary::models
