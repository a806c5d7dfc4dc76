// models/dot_forward.h against a product summed in double precision, for
// shapes with every kind of tail (rows, W's rows in fives, in % 8), with and
// without bias and ReLU; and the same bits on every call.
#include "models/dot_forward.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

namespace estuary::models {
namespace {

struct Case {
  std::vector<float> x, w, b, y;
};

Case Random(int n, int in, int out, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Case c;
  c.x.resize(size_t(n) * in);
  c.w.resize(size_t(out) * in);
  c.b.resize(out);
  for (float& v : c.x) v = normal(rng);
  for (float& v : c.w) v = normal(rng) * 0.05f;
  for (float& v : c.b) v = normal(rng) * 0.1f;
  c.y.assign(size_t(n) * out, std::nanf(""));
  return c;
}

TEST(DotForward, MatchesADoublePrecisionProductForEveryTail) {
  if (!HaveDotForward()) GTEST_SKIP() << "this CPU has no AVX2 and FMA: the kernel is never chosen here";
  for (auto [n, in, out] : {std::tuple{10, 784, 200}, std::tuple{10, 200, 10}, std::tuple{1, 1, 1},
                            std::tuple{3, 7, 4}, std::tuple{7, 9, 11}, std::tuple{32, 3136, 13},
                            std::tuple{2, 16, 5}, std::tuple{5, 801, 6}}) {
    for (bool bias : {false, true}) {
      for (bool relu : {false, true}) {
        Case c = Random(n, in, out, uint32_t(n * 1000 + in + out));
        DotForward(c.x.data(), n, in, c.w.data(), out, bias ? c.b.data() : nullptr, relu, c.y.data());
        for (int i = 0; i < n; ++i) {
          for (int o = 0; o < out; ++o) {
            double sum = bias ? c.b[o] : 0.0, scale = bias ? std::fabs(c.b[o]) : 0.0;
            for (int k = 0; k < in; ++k) {
              sum += double(c.x[size_t(i) * in + k]) * c.w[size_t(o) * in + k];
              scale += std::fabs(double(c.x[size_t(i) * in + k]) * c.w[size_t(o) * in + k]);
            }
            if (relu) sum = std::max(sum, 0.0);
            const float got = c.y[size_t(i) * out + o];
            ASSERT_NEAR(got, sum, 1e-5 * scale + 1e-30)
                << "n " << n << " in " << in << " out " << out << " row " << i << " output " << o;
            if (relu) {
              ASSERT_GE(got, 0.0f);
            }
          }
        }
      }
    }
  }
}

TEST(DotForward, GivesTheSameBitsOnEveryCall) {
  if (!HaveDotForward()) GTEST_SKIP() << "this CPU has no AVX2 and FMA: the kernel is never chosen here";
  Case c = Random(10, 784, 200, 7);
  std::vector<float> again(c.y.size());
  DotForward(c.x.data(), 10, 784, c.w.data(), 200, c.b.data(), true, c.y.data());
  DotForward(c.x.data(), 10, 784, c.w.data(), 200, c.b.data(), true, again.data());
  EXPECT_EQ(0, std::memcmp(c.y.data(), again.data(), c.y.size() * sizeof(float)));
}

}  // namespace
}  // namespace estuary::models
