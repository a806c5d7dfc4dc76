// The discrete Gaussian sampler against its exact probability mass function:
// Pearson's chi-square over bins of the integers, for small and large σ², with
// a rounded continuous Gaussian as the negative control that must fail it.
#include "secagg/discrete_gaussian.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "tests/secagg/test_util.h"

namespace estuary::secagg {
namespace {

using testing::CountingKey;

// The chi-square quantile at 1 − 1e-3 by Wilson and Hilferty (within 1 % for
// the degrees of freedom used here).
double ChiSquareCritical(int dof) {
  const double z = 3.0902, k = dof;
  const double c = 1 - 2 / (9 * k) + z * std::sqrt(2 / (9 * k));
  return k * c * c * c;
}

// The exact pmf of N_Z(0, V) on [−R, R], R = 12σ + 10 (beyond it the mass is
// below e^−72), normalised over that range in long double.
std::map<int64_t, long double> ExactPmf(uint64_t variance) {
  const int64_t range = int64_t(12 * std::sqrt(double(variance))) + 10;
  std::map<int64_t, long double> pmf;
  long double total = 0;
  for (int64_t x = -range; x <= range; ++x) {
    const long double p = std::exp(-(long double)(x) * x / (2.0L * variance));
    pmf[x] = p;
    total += p;
  }
  for (auto& [x, p] : pmf) p /= total;
  return pmf;
}

// Pearson's statistic of `samples` against `pmf`, in bins of consecutive
// integers each with an expected count of at least `min_expected` (the tails
// pooled into the outermost bins); returns {statistic, degrees of freedom}.
std::pair<double, int> ChiSquare(const std::vector<int64_t>& samples, const std::map<int64_t, long double>& pmf,
                                 double min_expected) {
  const double n = double(samples.size());
  std::vector<std::pair<int64_t, long double>> bins;  // (first integer of the bin, its mass)
  long double mass = 0;
  int64_t first = pmf.begin()->first;
  for (const auto& [x, p] : pmf) {
    mass += p;
    if (mass * n >= min_expected) {
      bins.push_back({first, mass});
      mass = 0;
      first = x + 1;
    }
  }
  bins.back().second += mass;  // the right tail joins the last bin
  std::vector<double> observed(bins.size(), 0);
  for (int64_t sample : samples) {
    size_t b = 0;
    // The last bin whose first integer is <= sample (the left tail: bin 0).
    auto it = std::upper_bound(bins.begin(), bins.end(), sample,
                               [](int64_t v, const auto& bin) { return v < bin.first; });
    if (it != bins.begin()) b = size_t(it - bins.begin()) - 1;
    observed[b] += 1;
  }
  double statistic = 0;
  for (size_t b = 0; b < bins.size(); ++b) {
    const double expected = double(bins[b].second) * n;
    statistic += (observed[b] - expected) * (observed[b] - expected) / expected;
  }
  return {statistic, int(bins.size()) - 1};
}

std::vector<int64_t> Draw(uint64_t variance, size_t count, uint8_t key) {
  auto sampler = DiscreteGaussianSampler::Create(variance, CountingKey(key));
  EXPECT_TRUE(sampler.ok()) << sampler.status().ToString();
  std::vector<int64_t> samples;
  samples.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    auto x = sampler->Next();
    EXPECT_TRUE(x.ok()) << x.status().ToString();
    samples.push_back(*x);
  }
  return samples;
}

TEST(DiscreteGaussian, MatchesTheExactPmfByChiSquare) {
  // σ² = 1, 2, 3: t = 2 and σ²/t not an integer; 50 and 10^6: wide
  // Laplace draws (the large σ² is the next test's).
  for (uint64_t variance : {uint64_t{1}, uint64_t{2}, uint64_t{3}, uint64_t{50}, uint64_t{1000000}}) {
    const auto samples = Draw(variance, 200000, uint8_t(variance));
    const auto [statistic, dof] = ChiSquare(samples, ExactPmf(variance), 20);
    EXPECT_LT(statistic, ChiSquareCritical(dof)) << "σ² = " << variance << ", " << dof << " degrees of freedom";
    EXPECT_GE(dof, variance == 1 ? 6 : 10) << variance;
    double sum = 0, squares = 0;
    for (int64_t x : samples) {
      sum += double(x);
      squares += double(x) * double(x);
    }
    const double mean = sum / samples.size(), var = squares / samples.size() - mean * mean;
    // The variance of N_Z(0, V) is V to within V·e^−(2π²V)-ish for V ≥ 1
    // (just under V); the sample variance's standard error is V·√(2/n).
    EXPECT_NEAR(var, double(variance), 5 * double(variance) * std::sqrt(2.0 / samples.size())) << variance;
    EXPECT_NEAR(mean, 0, 5 * std::sqrt(double(variance) / samples.size())) << variance;
  }
}

TEST(DiscreteGaussian, LargeVarianceMatchesTheNormalBins) {
  // σ² = 2^50 (σ = 2^25): bins of width σ/4 out to ±4σ, tails pooled; for σ
  // this large the discrete Gaussian's bin masses equal the normal's (Φ
  // differences) to far below the test's resolution.
  const uint64_t variance = uint64_t{1} << 50;
  const double sigma = std::sqrt(double(variance));
  const auto samples = Draw(variance, 100000, 77);
  std::vector<double> edges;
  for (int i = -16; i <= 16; ++i) edges.push_back(i * sigma / 4);
  std::vector<double> observed(edges.size() + 1, 0);
  for (int64_t x : samples) observed[std::upper_bound(edges.begin(), edges.end(), double(x)) - edges.begin()] += 1;
  auto cdf = [&](double x) { return 0.5 * std::erfc(-x / (sigma * std::sqrt(2.0))); };
  double statistic = 0;
  for (size_t b = 0; b < observed.size(); ++b) {
    const double lo = b == 0 ? 0 : cdf(edges[b - 1]), hi = b == edges.size() ? 1 : cdf(edges[b]);
    const double expected = (hi - lo) * samples.size();
    statistic += (observed[b] - expected) * (observed[b] - expected) / expected;
  }
  EXPECT_LT(statistic, ChiSquareCritical(int(observed.size()) - 1));
}

TEST(DiscreteGaussian, RoundedContinuousGaussianFailsTheSameTest) {
  // The negative control: N(0, 1) rounded to the nearest integer puts 0.383
  // on 0 where N_Z(0, 1) puts 0.399; 200,000 draws tell them apart.
  std::mt19937_64 generator(5);
  std::normal_distribution<double> normal(0, 1);
  std::vector<int64_t> rounded;
  for (int i = 0; i < 200000; ++i) rounded.push_back(std::llround(normal(generator)));
  const auto [statistic, dof] = ChiSquare(rounded, ExactPmf(1), 20);
  EXPECT_GT(statistic, 10 * ChiSquareCritical(dof));
}

TEST(DiscreteGaussian, SameKeySameDrawsOtherKeyOthers) {
  const auto a = Draw(1000, 1000, 3), b = Draw(1000, 1000, 3), c = Draw(1000, 1000, 4);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

TEST(DiscreteGaussian, AddsInTheRingWithWraparound) {
  // b = 8: values near 0 and 255 take the noise mod 256; the draws are the
  // sampler's own, in order.
  std::vector<uint32_t> values = {0, 1, 254, 255, 128, 7, 0, 255};
  const std::vector<uint32_t> before = values;
  ASSERT_TRUE(AddDiscreteGaussian(values, 9, 8, CountingKey(40)).ok());
  const auto noise = Draw(9, values.size(), 40);
  bool wrapped = false;
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(values[i], uint32_t(int64_t(before[i]) + noise[i] + 256) % 256) << i;
    wrapped |= int64_t(before[i]) + noise[i] < 0 || int64_t(before[i]) + noise[i] > 255;
  }
  EXPECT_TRUE(wrapped) << "no draw crossed the ring's edge: the test proves nothing about wrapping";
}

TEST(DiscreteGaussian, BadVarianceRefused) {
  EXPECT_EQ(DiscreteGaussianSampler::Create(0, CountingKey(1)).status().message(),
            "secagg: discrete Gaussian variance 0: must be in [1, 2^52]");
  EXPECT_FALSE(DiscreteGaussianSampler::Create((uint64_t{1} << 52) + 1, CountingKey(1)).ok());
  EXPECT_TRUE(DiscreteGaussianSampler::Create(uint64_t{1} << 52, CountingKey(1)).ok());
  std::vector<uint32_t> values(3, 0);
  EXPECT_FALSE(AddDiscreteGaussian(values, 4, 33, CountingKey(1)).ok());
}

}  // namespace
}  // namespace estuary::secagg
