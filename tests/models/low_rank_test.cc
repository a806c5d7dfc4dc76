// models::LowRankMatrix: AddTo is u·v summed in double over the rank in order
// k = 0, 1, ..., added to the target and rounded once, so the server folding a
// residual and a client patching its copy compute the same bits.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "models/low_rank.h"

namespace estuary::models {
namespace {

LowRankMatrix Random(uint64_t rows, uint64_t cols, uint64_t rank, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> value(0.0f, 1.0f);
  LowRankMatrix m{.rows = rows, .cols = cols, .rank = rank};
  m.u.resize(rows * rank);
  m.v.resize(rank * cols);
  for (float& x : m.u) x = value(gen);
  for (float& x : m.v) x = value(gen);
  return m;
}

TEST(LowRankMatrix, AddToIsTheProductSummedInDoubleAndRoundedOnce) {
  const LowRankMatrix m = Random(37, 53, 5, 1);
  std::vector<float> target(37 * 53);
  std::mt19937 gen(2);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  for (float& x : target) x = value(gen);
  std::vector<float> want = target;
  double worst = 0;
  for (uint64_t r = 0; r < m.rows; ++r) {
    for (uint64_t c = 0; c < m.cols; ++c) {
      double sum = 0;
      float single = 0;  // what a float GEMM would add, for scale
      for (uint64_t k = 0; k < m.rank; ++k) {
        sum += double(m.u[r * m.rank + k]) * double(m.v[k * m.cols + c]);
        single += m.u[r * m.rank + k] * m.v[k * m.cols + c];
      }
      float& w = want[r * m.cols + c];
      worst = std::max(worst, std::abs(double(single) - sum) / (std::abs(sum) + 1e-30));
      w = float(double(w) + sum);
    }
  }
  std::vector<float> got = target;
  m.AddTo(got);
  EXPECT_EQ(got, want);  // bit for bit: the contract both ends rely on
  EXPECT_LT(worst, 1e-4);  // and a float product agrees to rounding: it is the same matrix

  std::vector<float> again = target;
  m.AddTo(again);
  EXPECT_EQ(again, got);
  std::vector<float> zeros(37 * 53, 0.0f);
  m.AddTo(zeros);
  EXPECT_EQ(m.Dense(), zeros);
}

TEST(LowRankMatrix, BytesAsFactorsAndDense) {
  const LowRankMatrix m = Random(768, 768, 88, 3);
  EXPECT_EQ(m.factor_bytes(), 4u * 88 * (768 + 768));
  EXPECT_EQ(m.dense_bytes(), 4u * 768 * 768);
  EXPECT_FALSE(m.empty());
  EXPECT_TRUE(LowRankMatrix{}.empty());
}

}  // namespace
}  // namespace estuary::models
