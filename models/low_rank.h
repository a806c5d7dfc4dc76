// LowRankMatrix: a [rows, cols] matrix kept as the product u·v of its
// factors u [rows, rank] and v [rank, cols] (row-major fp32): (rows + cols)·rank
// values where the matrix has rows·cols.
//
// AddTo is the one way such a matrix is added to a weight, on the server that
// folds it into the global model and on the client that patches its copy: each
// element's sum over the rank runs in double, in one fixed order, with no
// BLAS (whose kernels differ per CPU), so both ends compute the same bits and
// the client's checksum of the patched model matches the server's.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace estuary::models {

struct LowRankMatrix {
  uint64_t rows = 0, cols = 0, rank = 0;
  std::vector<float> u = {};  // [rows, rank]
  std::vector<float> v = {};  // [rank, cols]

  bool empty() const { return rank == 0; }
  uint64_t factor_bytes() const { return uint64_t(4) * rank * (rows + cols); }
  uint64_t dense_bytes() const { return uint64_t(4) * rows * cols; }
  // target [rows, cols] += u·v (target.size() must be rows·cols).
  void AddTo(std::span<float> target) const;
  // u·v as a dense [rows, cols] matrix: AddTo on zeros.
  std::vector<float> Dense() const;
};

}  // namespace estuary::models
