// LossScaler as a state machine with torch.cuda.amp.GradScaler's rules, and
// the CPU unscale pass: growth after exactly growth_interval clean steps,
// backoff with the counter reset, no growth past fp32, and a step with an
// injected inf (or NaN) that leaves every weight bit and the optimizer state
// (SGD's momentum, AdamW's moments and step count) unchanged.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "models/loss_scaler.h"
#include "models/optimizer.h"

namespace estuary::models {
namespace {

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

TEST(LossScaler, GrowsAfterExactly2000CleanSteps) {
  LossScaler scaler;
  EXPECT_EQ(scaler.scale(), 65536.0f);
  EXPECT_EQ(scaler.inv_scale(), 1.0f / 65536.0f);
  for (int i = 0; i < 1999; ++i) scaler.Update(false);
  EXPECT_EQ(scaler.scale(), 65536.0f);
  EXPECT_EQ(scaler.growth_tracker(), 1999);
  scaler.Update(false);
  EXPECT_EQ(scaler.scale(), 131072.0f);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  for (int i = 0; i < 1999; ++i) scaler.Update(false);
  EXPECT_EQ(scaler.scale(), 131072.0f);
  scaler.Update(false);
  EXPECT_EQ(scaler.scale(), 262144.0f);
}

TEST(LossScaler, OverflowBacksOffAndRestartsTheCount) {
  LossScaler scaler;
  for (int i = 0; i < 1500; ++i) scaler.Update(false);
  scaler.Update(true);
  EXPECT_EQ(scaler.scale(), 32768.0f);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  // 1500 + 1999 clean steps would have grown the scale had the count not restarted.
  for (int i = 0; i < 1999; ++i) scaler.Update(false);
  EXPECT_EQ(scaler.scale(), 32768.0f);
  scaler.Update(false);
  EXPECT_EQ(scaler.scale(), 65536.0f);
  for (int i = 0; i < 3; ++i) scaler.Update(true);
  EXPECT_EQ(scaler.scale(), 8192.0f);
  EXPECT_EQ(scaler.inv_scale(), 1.0f / 8192.0f);
}

TEST(LossScaler, CustomOptionsAndNoGrowthPastFp32) {
  LossScaler small({.init_scale = 8.0f, .growth_factor = 4.0, .backoff_factor = 0.25, .growth_interval = 3});
  small.Update(false);
  small.Update(false);
  EXPECT_EQ(small.scale(), 8.0f);
  small.Update(false);
  EXPECT_EQ(small.scale(), 32.0f);
  small.Update(true);
  EXPECT_EQ(small.scale(), 8.0f);

  LossScaler huge({.init_scale = 0x1.0p127f});
  for (int i = 0; i < 2000; ++i) huge.Update(false);
  EXPECT_EQ(huge.scale(), 0x1.0p127f);  // 2^128 is inf in fp32: the scale stays
  EXPECT_EQ(huge.growth_tracker(), 0);  // and the count restarts, as in torch
}

TEST(LossScaler, UnscaleMultipliesEverythingAndFlagsNonFinite) {
  const float inv = 1.0f / 1024.0f;
  std::vector<float> g = {1024.0f, -2048.0f, 3.0e38f, 0.5f};
  EXPECT_FALSE(UnscaleAndCheckFinite(g, inv));
  EXPECT_EQ(g[0], 1.0f);
  EXPECT_EQ(g[1], -2.0f);
  EXPECT_EQ(g[2], 3.0e38f * inv);
  EXPECT_EQ(g[3], 0.5f * inv);
  for (float bad : {INFINITY, -INFINITY, std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> h = {2048.0f, bad, 4096.0f};
    EXPECT_TRUE(UnscaleAndCheckFinite(h, inv)) << bad;
    EXPECT_EQ(h[0], 2.0f);
    EXPECT_EQ(h[2], 4.0f);  // the pass goes on after the non-finite value
  }
}

// The skipped step must not touch the weights (bit for bit) nor the momentum
// buffer: the next clean step lands exactly where a run without it does.
TEST(LossScaler, StepWithInfLeavesWeightsAndOptimizerStateUnchanged) {
  const size_t n = 1000;
  std::vector<float> params = Random(n, 1), reference = params;
  Sgd sgd(0.1f, 0.9f, 1e-3f), reference_sgd(0.1f, 0.9f, 1e-3f);
  LossScaler scaler;
  const float scale = scaler.scale();

  auto scaled = [&](uint32_t seed) {
    std::vector<float> g = Random(n, seed);
    for (float& x : g) x *= scale;
    return g;
  };
  std::vector<float> g1 = scaled(2);
  ASSERT_TRUE(scaler.Step(g1, [&] { sgd.Step(params, g1); }));
  std::vector<float> r1 = scaled(2);
  UnscaleAndCheckFinite(r1, 1.0f / scale);
  reference_sgd.Step(reference, r1);
  ASSERT_EQ(std::memcmp(params.data(), reference.data(), n * sizeof(float)), 0);

  const std::vector<float> before = params;
  std::vector<float> bad = scaled(3);
  bad[417] = INFINITY;
  bool ran = false;
  EXPECT_FALSE(scaler.Step(bad, [&] {
    ran = true;
    sgd.Step(params, bad);
  }));
  EXPECT_FALSE(ran);
  EXPECT_EQ(std::memcmp(params.data(), before.data(), n * sizeof(float)), 0);
  EXPECT_EQ(scaler.scale(), scale / 2);
  EXPECT_EQ(scaler.growth_tracker(), 0);

  std::vector<float> g2 = Random(n, 4);
  for (float& x : g2) x *= scaler.scale();
  ASSERT_TRUE(scaler.Step(g2, [&] { sgd.Step(params, g2); }));
  std::vector<float> r2 = Random(n, 4);
  for (float& x : r2) x *= scale / 2;
  UnscaleAndCheckFinite(r2, 2.0f / scale);
  reference_sgd.Step(reference, r2);
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), n * sizeof(float)), 0);
  EXPECT_EQ(scaler.growth_tracker(), 1);
}

// The same with AdamW, whose state also counts steps: a skipped step must not
// advance the bias corrections nor move the moments.
TEST(LossScaler, SkippedAdamWStepKeepsStepCountAndMoments) {
  const size_t n = 513;
  std::vector<float> params = Random(n, 5);
  AdamW adamw({.lr = 1e-2f});
  LossScaler scaler;
  std::vector<float> g = Random(n, 6);
  for (float& x : g) x *= scaler.scale();
  ASSERT_TRUE(scaler.Step(g, [&] { adamw.Step(params, g); }));
  const std::vector<float> p1 = params;
  const std::vector<float> m1(adamw.first_moment().begin(), adamw.first_moment().end());
  const std::vector<float> v1(adamw.second_moment().begin(), adamw.second_moment().end());

  std::vector<float> bad = Random(n, 7);
  bad[0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(scaler.Step(bad, [&] { adamw.Step(params, bad); }));
  EXPECT_EQ(adamw.step_count(), 1);
  EXPECT_EQ(std::memcmp(params.data(), p1.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(adamw.first_moment().data(), m1.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(adamw.second_moment().data(), v1.data(), n * sizeof(float)), 0);
  EXPECT_EQ(scaler.scale(), 32768.0f);
}

}  // namespace
}  // namespace estuary::models
