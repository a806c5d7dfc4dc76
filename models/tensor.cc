#include "models/tensor.h"

namespace estuary::models {

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace estuary::models
