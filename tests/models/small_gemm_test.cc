// models/small_gemm.h: every form of the product, on both engines, against a
// double-precision product of the same operands; the routing rule; and the
// same bits from every thread.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "models/small_gemm.h"

namespace estuary::models {
namespace {

struct Case {
  bool trans_a, trans_b;
  int m, n, k;
  float alpha, beta;
};

// Deterministic operands in [-1, 1), with leading dimensions wider than the
// rows so that an engine reading the wrong stride gets other numbers.
std::vector<float> Operand(size_t size, uint32_t seed) {
  std::vector<float> v(size);
  for (float& x : v) {
    seed = seed * 1664525u + 1013904223u;
    x = float(seed >> 8) * 0x1.0p-23f - 1.0f;
  }
  return v;
}

// C = alpha·op(A)·op(B) + beta·C in double; returns max |C - ref| / max |ref|.
double Check(const Case& c, GemmEngine engine) {
  const int rows_a = c.trans_a ? c.k : c.m, cols_a = c.trans_a ? c.m : c.k;
  const int rows_b = c.trans_b ? c.n : c.k, cols_b = c.trans_b ? c.k : c.n;
  const int lda = cols_a + 3, ldb = cols_b + 5, ldc = c.n + 2;
  const std::vector<float> a = Operand(size_t(rows_a) * lda, 1), b = Operand(size_t(rows_b) * ldb, 2);
  std::vector<float> out = Operand(size_t(c.m) * ldc, 3);
  std::vector<double> ref(out.begin(), out.end());
  for (int i = 0; i < c.m; ++i) {
    for (int j = 0; j < c.n; ++j) {
      double sum = 0;
      for (int p = 0; p < c.k; ++p) {
        const double av = c.trans_a ? a[size_t(p) * lda + i] : a[size_t(i) * lda + p];
        const double bv = c.trans_b ? b[size_t(j) * ldb + p] : b[size_t(p) * ldb + j];
        sum += av * bv;
      }
      double& r = ref[size_t(i) * ldc + j];
      r = c.alpha * sum + (c.beta == 0 ? 0.0 : c.beta * r);
    }
  }
  SgemmOn(engine, c.trans_a, c.trans_b, c.m, c.n, c.k, c.alpha, a.data(), lda, b.data(), ldb, c.beta, out.data(), ldc);
  double diff = 0, scale = 1e-30;
  for (int i = 0; i < c.m; ++i) {
    for (int j = 0; j < c.n; ++j) {
      const double r = ref[size_t(i) * ldc + j];
      diff = std::max(diff, std::abs(out[size_t(i) * ldc + j] - r));
      scale = std::max(scale, std::abs(r));
    }
    // Beyond n, in the leading dimension's padding, nothing may be written.
    for (int j = c.n; j < ldc; ++j) EXPECT_EQ(out[size_t(i) * ldc + j], float(ref[size_t(i) * ldc + j])) << i;
  }
  return diff / scale;
}

TEST(SmallGemm, EveryFormMatchesADoubleProductOnBothEngines) {
  const std::vector<Case> cases = {
      {false, false, 10, 200, 784, 1, 0},           // the forward as Yᵀ = W·Xᵀ (fc1, batch 10)
      {false, true, 10, 200, 784, 1, 1},            // the forward as Y = X·Wᵀ: OpenBLAS only
      {true, false, 200, 784, 10, 1, 1},            // W += dYᵀ·X
      {true, false, 200, 784, 10, -0.05f, 0.99f},   // W = keep·W - lr·dYᵀ·X: alpha, beta for OpenBLAS
      {false, false, 10, 784, 200, 1, 0},           // dX = dY·W
      {false, false, 200, 10, 784, 1, 0},
      {false, true, 7, 5, 13, 1, 0},
      {true, true, 9, 11, 3, 0.5f, 2},
      {false, false, 64, 96, 80, 1, 1},
      {true, false, 3, 4, 0, 1, 0.5f}};             // k = 0: C = beta·C
  for (const Case& c : cases) {
    for (GemmEngine engine : {GemmEngine::kXsmm, GemmEngine::kOpenBlas}) {
      EXPECT_LE(Check(c, engine), 1e-5) << "m " << c.m << " n " << c.n << " k " << c.k << " trans " << c.trans_a
                                        << c.trans_b << " alpha " << c.alpha << " beta " << c.beta << " engine "
                                        << int(engine);
    }
  }
}

TEST(SmallGemm, SmallBatchProductsGoToLibxsmmTheRestToOpenBlas) {
  if (!HaveXsmm()) GTEST_SKIP() << "built without libxsmm: OpenBLAS does every product";
  // The flagship MLP's step at batch 10: W += dYᵀ·X, dX = dY·W, and the forward as Yᵀ = W·Xᵀ.
  EXPECT_EQ(ChooseGemmEngine(true, false, 200, 784, 10, 1, 1), GemmEngine::kXsmm);
  EXPECT_EQ(ChooseGemmEngine(false, false, 10, 200, 200, 1, 0), GemmEngine::kXsmm);
  EXPECT_EQ(ChooseGemmEngine(false, false, 200, 10, 784, 1, 0), GemmEngine::kXsmm);
  // What libxsmm cannot do: a transposed B, alpha other than 1, beta other than 0 or 1.
  EXPECT_EQ(ChooseGemmEngine(false, true, 10, 200, 784, 1, 0), GemmEngine::kOpenBlas);
  EXPECT_EQ(ChooseGemmEngine(true, false, 200, 784, 10, -0.05f, 1), GemmEngine::kOpenBlas);
  EXPECT_EQ(ChooseGemmEngine(true, false, 200, 784, 10, 1, 0.5f), GemmEngine::kOpenBlas);
  // No small dimension (evaluation at batch 500): OpenBLAS.
  EXPECT_EQ(ChooseGemmEngine(false, false, 200, 500, 784, 1, 0), GemmEngine::kOpenBlas);
  // The forward as yᵀ = W·xᵀ with AVX-512's kernels: for every layer at batch 10 and at evaluation's 32
  // (fc3 too, so that a row's logits do not depend on its batch), not at 500; with AVX2's, at 8, 16, 32
  // (whole vectors), not at 10 or 20.
  for (auto [n, in, out] : {std::tuple{10, 784, 200}, std::tuple{10, 200, 200}, std::tuple{10, 200, 10},
                            std::tuple{32, 3136, 512}, std::tuple{20, 784, 200}}) {
    EXPECT_TRUE(XsmmForwardPaysAtWidth(16, n, in, out)) << n << " " << in << " " << out;
    EXPECT_FALSE(XsmmForwardPaysAtWidth(8, n, in, out) && n % 8 != 0) << n << " " << in << " " << out;
  }
  for (int n : {8, 16, 24, 32}) EXPECT_TRUE(XsmmForwardPaysAtWidth(8, n, 784, 200)) << n;
  for (int n : {10, 20, 30}) EXPECT_FALSE(XsmmForwardPaysAtWidth(8, n, 784, 200)) << n;
  EXPECT_FALSE(XsmmForwardPaysAtWidth(16, 500, 784, 200));
  EXPECT_FALSE(XsmmForwardPaysAtWidth(8, 512, 784, 200));
  EXPECT_FALSE(XsmmForwardPaysAtWidth(0, 32, 784, 200));
  const std::string target = XsmmTarget();
  if (target == "hsw") EXPECT_FALSE(XsmmForwardPays(10, 784, 200));
  if (target == "skx" || target == "clx" || target == "cpx") EXPECT_TRUE(XsmmForwardPays(10, 784, 200));
  // The CNN's convolutions, per image, by their size: conv2's forward, weight product and columns' gradient.
  EXPECT_EQ(ChooseGemmEngine(false, false, 64, 196, 800, 1, 1), GemmEngine::kXsmm);
  EXPECT_EQ(ChooseGemmEngine(false, false, 800, 64, 196, 1, 0), GemmEngine::kXsmm);
  EXPECT_EQ(ChooseGemmEngine(true, false, 800, 196, 64, 1, 0), GemmEngine::kXsmm);
  // A large product with no small dimension stays on OpenBLAS (the CNN's fc1 at batch 500).
  EXPECT_EQ(ChooseGemmEngine(true, false, 512, 3136, 500, 1, 0), GemmEngine::kOpenBlas);
  EXPECT_NE(std::string(XsmmTarget()), "none");
}

TEST(SmallGemm, EveryThreadGetsTheSameBits) {
  const int m = 10, n = 200, k = 784;
  const std::vector<float> a = Operand(size_t(m) * k, 4), b = Operand(size_t(k) * n, 5);
  auto run = [&](std::vector<float>& c) {
    for (int rep = 0; rep < 3; ++rep) Sgemm(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 1.0f, c.data(), n);
  };
  std::vector<float> here(size_t(m) * n, 0.25f), there = here;
  run(here);
  std::thread other([&] { run(there); });
  other.join();
  EXPECT_EQ(here, there);
}

}  // namespace
}  // namespace estuary::models
