#include "secagg/quantize.h"

#include <gtest/gtest.h>

#include <cmath>

#include "secagg/prg.h"
#include "tests/secagg/test_util.h"

namespace estuary::secagg {
namespace {

using testing::CountingKey;

TEST(Quantize, IntegersAreExactAndNegativesAreTwosComplement) {
  const QuantizationConfig config{.bits = 16, .clip_norm = 100, .scale = 4};
  const std::vector<float> update = {0.0f, 1.0f, -1.0f, 2.5f, -2.5f};
  auto q = Quantize(update, 1, config, CountingKey(1));
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(*q, (std::vector<uint32_t>{0, 4, 65536 - 4, 10, 65536 - 10}));
  auto back = Dequantize(*q, 1, config);
  ASSERT_TRUE(back.ok());
  for (size_t i = 0; i < update.size(); ++i) EXPECT_DOUBLE_EQ((*back)[i], update[i]);
}

TEST(Quantize, WeightMultipliesBeforeRounding) {
  const QuantizationConfig config{.bits = 32, .clip_norm = 100, .scale = 8};
  auto q = Quantize(std::vector<float>{0.5f, -0.25f}, 3, config, CountingKey(1));
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(*q, (std::vector<uint32_t>{12, static_cast<uint32_t>(-6)}));
}

TEST(Quantize, StochasticRoundingIsUnbiasedAndSeeded) {
  const QuantizationConfig config{.bits = 32, .clip_norm = 1e9, .scale = 1};
  const size_t n = 200'000;
  const std::vector<float> update(n, 0.3f);
  auto q = Quantize(update, 1, config, CountingKey(2));
  ASSERT_TRUE(q.ok());
  double sum = 0;
  for (uint32_t v : *q) {
    ASSERT_TRUE(v == 0 || v == 1) << v;
    sum += v;
  }
  // Rounds up with probability 0.3: within 5 standard errors of 0.3.
  EXPECT_NEAR(sum / n, 0.3, 5 * std::sqrt(0.21 / n));
  auto again = Quantize(update, 1, config, CountingKey(2));
  auto other = Quantize(update, 1, config, CountingKey(3));
  ASSERT_TRUE(again.ok() && other.ok());
  EXPECT_EQ(*again, *q);
  EXPECT_NE(*other, *q);
  // Negative fractions round to the two neighbouring integers too: −0.3 to −1 or 0.
  auto negative = Quantize(std::vector<float>(1000, -0.3f), 1, config, CountingKey(2));
  ASSERT_TRUE(negative.ok());
  for (uint32_t v : *negative) ASSERT_TRUE(v == 0 || v == 0xffffffffu) << v;
}

TEST(Quantize, ClipsToTheNorm) {
  auto clipped = ClipToNorm(std::vector<float>{3.0f, 4.0f}, 1.0);
  ASSERT_TRUE(clipped.ok());
  EXPECT_NEAR((*clipped)[0], 0.6, 1e-12);
  EXPECT_NEAR((*clipped)[1], 0.8, 1e-12);
  auto within = ClipToNorm(std::vector<float>{0.3f, 0.4f}, 1.0);
  ASSERT_TRUE(within.ok());
  EXPECT_EQ((*within)[0], double(0.3f));
  const QuantizationConfig config{.bits = 32, .clip_norm = 1, .scale = 10};
  auto q = Quantize(std::vector<float>{30.0f, -40.0f}, 1, config, CountingKey(1));
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(*q, (std::vector<uint32_t>{6, static_cast<uint32_t>(-8)}));
}

TEST(Quantize, OverflowBoundIsExact) {
  // Each site reaches |q| <= 1 · 1 · 100 + 1 = 101; 2^15 − 1 = 32767.
  const QuantizationConfig config{.bits = 16, .clip_norm = 1, .scale = 100};
  EXPECT_TRUE(CheckNoOverflow(std::vector<double>(324, 1.0), config).ok());   // 32724
  auto refused = CheckNoOverflow(std::vector<double>(325, 1.0), config);     // 32825
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("would wrap"), std::string::npos);
  // And wrapping is real: at +clip exactly (q = 100, no rounding) 327 sites
  // sum to 32700 and read back right, 328 sum to 32800 > 32767 and read back
  // negative.
  for (int sites : {327, 328}) {
    std::vector<uint32_t> sum(1, 0);
    for (int site = 0; site < sites; ++site) {
      auto q = Quantize(std::vector<float>{1.0f}, 1, config, CountingKey(static_cast<uint8_t>(site)));
      ASSERT_TRUE(q.ok());
      ASSERT_EQ((*q)[0], 100u);
      sum[0] = (sum[0] + (*q)[0]) & RingMask(16);
    }
    auto mean = Dequantize(sum, sites, config);
    ASSERT_TRUE(mean.ok());
    if (sites == 327) EXPECT_DOUBLE_EQ((*mean)[0], 1.0);
    else EXPECT_LT((*mean)[0], 0);
  }
}

TEST(Quantize, DequantizedSumIsWithinTheBound) {
  const QuantizationConfig config{.bits = 24, .clip_norm = 2, .scale = 1000};
  const std::vector<double> weights = {1, 2, 3, 4};
  ASSERT_TRUE(CheckNoOverflow(weights, config).ok());
  const size_t n = 5000;
  std::vector<uint32_t> sum(n, 0);
  std::vector<double> exact(n, 0);
  double total = 0;
  for (size_t s = 0; s < weights.size(); ++s) {
    std::vector<float> update(n);
    for (size_t i = 0; i < n; ++i) update[i] = static_cast<float>(std::sin(double(i * (s + 1))) * 0.05);
    auto clipped = ClipToNorm(update, config.clip_norm);
    auto q = Quantize(update, weights[s], config, CountingKey(static_cast<uint8_t>(s)));
    ASSERT_TRUE(clipped.ok() && q.ok());
    for (size_t i = 0; i < n; ++i) {
      sum[i] = (sum[i] + (*q)[i]) & RingMask(config.bits);
      exact[i] += weights[s] * (*clipped)[i];
    }
    total += weights[s];
  }
  auto mean = Dequantize(sum, total, config);
  ASSERT_TRUE(mean.ok());
  const double bound = DequantizationErrorBound(4, total, config);
  double worst = 0;
  for (size_t i = 0; i < n; ++i) worst = std::max(worst, std::abs((*mean)[i] - exact[i] / total));
  EXPECT_LE(worst, bound);
  EXPECT_GT(worst, bound / 100);  // rounding did happen: the check is not vacuous
}

TEST(Quantize, BadInputsAreRefusedInOneLine) {
  const QuantizationConfig config{.bits = 16, .clip_norm = 1, .scale = 100};
  const std::vector<Status> refusals = {
      Quantize(std::vector<float>{NAN}, 1, config, CountingKey(1)).status(),
      Quantize(std::vector<float>{INFINITY}, 1, config, CountingKey(1)).status(),
      Quantize(std::vector<float>{1}, -1, config, CountingKey(1)).status(),
      Quantize(std::vector<float>{1}, 1000, config, CountingKey(1)).status(),  // 100001 > 32767 alone
      Quantize(std::vector<float>{1}, 1, {.bits = 33}, CountingKey(1)).status(),
      Quantize(std::vector<float>{1}, 1, {.bits = 16, .clip_norm = 0}, CountingKey(1)).status(),
      Quantize(std::vector<float>{1}, 1, {.bits = 16, .scale = NAN}, CountingKey(1)).status(),
      Dequantize(std::vector<uint32_t>{1}, 0, config).status(),
  };
  for (const Status& status : refusals) {
    ASSERT_FALSE(status.ok());
    EXPECT_EQ(status.code(), Code::kInvalidArgument);
    EXPECT_EQ(status.message().find('\n'), std::string::npos);
  }
  EXPECT_NE(refusals[0].message().find("update[0]"), std::string::npos) << refusals[0].message();
}

}  // namespace
}  // namespace estuary::secagg
