#include "models/low_rank.h"

#include <algorithm>
#include <cassert>

namespace estuary::models {

void LowRankMatrix::AddTo(std::span<float> target) const {
  assert(target.size() == rows * cols && u.size() == rows * rank && v.size() == rank * cols);
  std::vector<double> row(cols);
  for (uint64_t r = 0; r < rows; ++r) {
    std::fill(row.begin(), row.end(), 0.0);
    // Along a row of v at a time: contiguous, and each element still sums
    // over the rank in the order k = 0, 1, ...
    for (uint64_t k = 0; k < rank; ++k) {
      const double ur = u[r * rank + k];
      const float* vk = v.data() + k * cols;
      for (uint64_t c = 0; c < cols; ++c) row[c] += ur * double(vk[c]);
    }
    float* out = target.data() + r * cols;
    for (uint64_t c = 0; c < cols; ++c) out[c] = float(double(out[c]) + row[c]);
  }
}

std::vector<float> LowRankMatrix::Dense() const {
  std::vector<float> dense(rows * cols, 0.0f);
  AddTo(dense);
  return dense;
}

}  // namespace estuary::models
