// Optimizers over flat buffers, with PyTorch's semantics.
#pragma once

#include <span>
#include <vector>

namespace estuary::models {

// torch.optim.SGD: g += wd * p; buf = momentum * buf + g (buf = g on the first
// step); p -= lr * buf. With momentum == 0 no buffer is kept.
class Sgd {
 public:
  Sgd(float lr, float momentum, float weight_decay) : lr_(lr), momentum_(momentum), weight_decay_(weight_decay) {}
  void Step(std::span<float> params, std::span<const float> grads);
  void Reset() { momentum_buffer_.clear(); }

 private:
  float lr_, momentum_, weight_decay_;
  std::vector<float> momentum_buffer_;
};

}  // namespace estuary::models
