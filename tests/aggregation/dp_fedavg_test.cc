#include "aggregation/dp_fedavg.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "aggregation/dp_noise.h"
#include "aggregation/fedopt.h"
#include "aggregation/fedavg.h"
#include "aggregation/lora_strategy.h"
#include "models/lora_federation.h"

namespace estuary::aggregation {
namespace {

// A noise multiplier whose noise is far below float's resolution of the
// values folded here: the release is then the clipped mean itself.
constexpr double kNoNoise = 1e-15;

std::unique_ptr<DpFedAvg> MakeDp(DpOptions options) {
  return std::make_unique<DpFedAvg>(std::make_unique<FedAvg>(), std::move(options), std::nullopt);
}

double Norm(std::span<const float> v) {
  double squares = 0;
  for (float x : v) squares += double(x) * double(x);
  return std::sqrt(squares);
}

// One round from a zero model: what the release adds to it.
std::vector<float> Release(DpFedAvg& dp, uint64_t round, uint64_t sampled,
                           const std::vector<std::vector<float>>& updates) {
  std::vector<float> global(updates.at(0).size(), 0.0f);
  dp.PlanRound(sampled);
  EXPECT_TRUE(dp.Begin(round, global).ok());
  for (const auto& u : updates) EXPECT_TRUE(dp.Fold(u, 1234.0).ok());
  Status finished = dp.Finish(global);
  EXPECT_TRUE(finished.ok()) << finished.ToString();
  return global;
}

TEST(DpFedAvgTest, AnUpdateAboveTheClipNormIsScaledToItKeepingItsDirection) {
  auto dp = MakeDp({.noise_multiplier = kNoNoise, .clip = 2.0, .seed = 1});
  const std::vector<float> update = {6.0f, 0.0f, -8.0f};  // norm 10
  const std::vector<float> released = Release(*dp, 1, 1, {update});
  EXPECT_NEAR(Norm(released), 2.0, 1e-6);
  for (size_t i = 0; i < update.size(); ++i) EXPECT_NEAR(released[i], update[i] / 5.0, 1e-6) << i;
  EXPECT_EQ(dp->last_round().clipped, 1u);
}

TEST(DpFedAvgTest, AnUpdateBelowTheClipNormIsUntouched) {
  auto dp = MakeDp({.noise_multiplier = kNoNoise, .clip = 20.0, .seed = 1});
  const std::vector<float> update = {6.0f, 0.0f, -8.0f};
  const std::vector<float> released = Release(*dp, 1, 1, {update});
  for (size_t i = 0; i < update.size(); ++i) EXPECT_NEAR(released[i], update[i], 1e-9) << i;
  EXPECT_EQ(dp->last_round().clipped, 0u);
}

TEST(DpFedAvgTest, TheMeanIsOverTheSampledSitesNotThoseThatReportedNorTheirExamples) {
  auto dp = MakeDp({.noise_multiplier = kNoNoise, .clip = 100.0, .seed = 1});
  // Four sampled, two reported (weights 1234 each are ignored).
  const std::vector<float> released = Release(*dp, 1, 4, {{4.0f, 8.0f}, {4.0f, 0.0f}});
  EXPECT_FLOAT_EQ(released[0], 2.0f);  // (4 + 4) / 4, not / 2
  EXPECT_FLOAT_EQ(released[1], 2.0f);
  EXPECT_EQ(dp->last_round().sampled, 4u);
}

TEST(DpFedAvgTest, UnderPoissonSamplingTheMeanIsOverTheExpectedSitesForOneRoundOnly) {
  auto dp = MakeDp({.noise_multiplier = kNoNoise, .clip = 100.0, .seed = 1});
  // Two drawn, q · population = 2.5 expected: the sum over 2.5, not over 2.
  std::vector<float> global = {0.0f, 0.0f};
  dp->PlanRound(2);
  dp->PlanExpected(2.5);
  ASSERT_TRUE(dp->Begin(1, global).ok());
  ASSERT_TRUE(dp->Fold(std::vector<float>{4.0f, 8.0f}, 1234.0).ok());
  ASSERT_TRUE(dp->Fold(std::vector<float>{1.0f, 0.0f}, 1.0).ok());
  ASSERT_TRUE(dp->Finish(global).ok());
  EXPECT_FLOAT_EQ(global[0], 2.0f);  // (4 + 1) / 2.5
  EXPECT_FLOAT_EQ(global[1], 3.2f);  // 8 / 2.5
  EXPECT_EQ(dp->last_round().sampled, 2u);
  EXPECT_EQ(dp->last_round().denominator, 2.5);
  // The next round without PlanExpected divides by its planned count again.
  const std::vector<float> next = Release(*dp, 2, 2, {{4.0f, 8.0f}, {1.0f, 0.0f}});
  EXPECT_FLOAT_EQ(next[0], 2.5f);
  EXPECT_EQ(dp->last_round().denominator, 2.0);
}

TEST(DpFedAvgTest, MoreReportsThanSampledSitesAreRefused) {
  auto dp = MakeDp({.noise_multiplier = 1.0, .clip = 1.0, .seed = 1});
  std::vector<float> global(2, 0.0f), update = {1.0f, 1.0f};
  dp->PlanRound(1);
  ASSERT_TRUE(dp->Begin(1, global).ok());
  ASSERT_TRUE(dp->Fold(update, 1).ok());
  EXPECT_EQ(dp->Fold(update, 1).code(), Code::kFailedPrecondition);
}

TEST(DpFedAvgTest, BeginWithoutAPlannedSampleIsRefused) {
  auto dp = MakeDp({.noise_multiplier = 1.0, .clip = 1.0, .seed = 1});
  std::vector<float> global(2, 0.0f);
  EXPECT_EQ(dp->Begin(1, global).code(), Code::kFailedPrecondition);
}

// One site of a zero update: the release is the noise over 1, so its sample
// statistics over a million coordinates measure the noise itself. The sample
// stddev's own standard error is σ/√(2n) = 0.07 %, so 1 % is a bound a σ off
// by 10 % fails by far; the mean's standard error is σ/√n.
TEST(DpFedAvgTest, TheNoiseIsGaussianOfStddevNoiseMultiplierTimesClip) {
  constexpr size_t kCoordinates = 1'000'000;
  const double z = 1.3, clip = 0.7, sigma = z * clip;
  for (std::optional<uint64_t> seed : {std::optional<uint64_t>(7), std::optional<uint64_t>()}) {
    auto dp = MakeDp({.noise_multiplier = z, .clip = clip, .seed = seed});
    const std::vector<float> noise = Release(*dp, 3, 1, {std::vector<float>(kCoordinates, 0.0f)});
    double sum = 0, squares = 0;
    size_t within_one = 0, within_two = 0;
    for (float x : noise) {
      sum += x;
      squares += double(x) * x;
      within_one += std::abs(x) < sigma;
      within_two += std::abs(x) < 2 * sigma;
    }
    const double mean = sum / kCoordinates;
    const double stddev = std::sqrt(squares / kCoordinates - mean * mean);
    EXPECT_NEAR(stddev / sigma, 1.0, 0.01) << (seed ? "seeded" : "unpredictable");
    EXPECT_LT(std::abs(mean), 5 * sigma / std::sqrt(double(kCoordinates)));
    // The normal's mass within 1σ and 2σ (erf(1/√2), erf(√2)), ± 5 standard errors.
    EXPECT_NEAR(double(within_one) / kCoordinates, std::erf(1 / std::sqrt(2.0)), 0.0025);
    EXPECT_NEAR(double(within_two) / kCoordinates, std::erf(std::sqrt(2.0)), 0.0015);
    EXPECT_DOUBLE_EQ(dp->last_round().noise_stddev, clip * z);  // a fixed clip is C exactly
  }
}

TEST(DpFedAvgTest, SeededNoiseRepeatsPerSeedAndRoundAndUnpredictableNoiseDoesNot) {
  const std::vector<std::vector<float>> zero = {std::vector<float>(64, 0.0f)};
  auto a = MakeDp({.noise_multiplier = 1, .clip = 1, .seed = 5});
  auto b = MakeDp({.noise_multiplier = 1, .clip = 1, .seed = 5});
  EXPECT_EQ(Release(*a, 2, 1, zero), Release(*b, 2, 1, zero));
  EXPECT_NE(Release(*a, 2, 1, zero), Release(*a, 3, 1, zero));
  auto c = MakeDp({.noise_multiplier = 1, .clip = 1, .seed = 6});
  EXPECT_NE(Release(*a, 2, 1, zero), Release(*c, 2, 1, zero));
  auto d = MakeDp({.noise_multiplier = 1, .clip = 1});
  EXPECT_NE(Release(*d, 2, 1, zero), Release(*d, 2, 1, zero));
}

TEST(DpFedAvgTest, UniformsAreOnTheTwoToMinusFiftyThreeGridInZeroOne) {
  auto stream = GaussianStream::Seeded(1, 1);
  ASSERT_TRUE(stream.ok());
  for (int i = 0; i < 10000; ++i) {
    const double u = stream->NextUniform();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    ASSERT_EQ(u * 0x1p53, std::floor(u * 0x1p53));
  }
}

// A server restarted from its checkpoint after round 3 continues as one that
// never stopped: the same clip norm and, with seeded noise, the same model.
TEST(DpFedAvgTest, ARestartFromSavedStateContinuesTheAdaptiveClipAndTheModel) {
  const DpOptions options = {.noise_multiplier = 0.5, .clip = 0.05, .adaptive = true, .target_quantile = 0.5,
                             .clip_lr = 0.2, .seed = 11};
  auto inner = [] { return std::make_unique<FedOpt>(StrategyOptions{.name = "fedadam", .server_lr = 0.1}); };
  auto updates = [](uint64_t round) {
    std::vector<std::vector<float>> u;
    for (int site = 0; site < 10; ++site) u.push_back({float(round) * 0.01f, float(site) * 0.03f, 0.02f});
    return u;
  };
  auto run = [&](DpFedAvg& dp, std::vector<float>& global, uint64_t from, uint64_t to) {
    for (uint64_t round = from; round <= to; ++round) {
      dp.PlanRound(10);
      ASSERT_TRUE(dp.Begin(round, global).ok());
      for (const auto& u : updates(round)) ASSERT_TRUE(dp.Fold(u, 1).ok());
      ASSERT_TRUE(dp.Finish(global).ok());
    }
  };
  DpFedAvg straight(inner(), options, std::nullopt);
  std::vector<float> straight_global(3, 0.0f);
  run(straight, straight_global, 1, 6);

  DpFedAvg first(inner(), options, std::nullopt);
  std::vector<float> global(3, 0.0f);
  run(first, global, 1, 3);
  const auto saved = first.SaveState();
  ASSERT_TRUE(saved.contains("dp/clip"));
  ASSERT_TRUE(saved.contains("m"));  // the inner strategy's state rides along
  DpFedAvg resumed(inner(), options, std::nullopt);
  ASSERT_TRUE(resumed.LoadState(saved).ok());
  EXPECT_EQ(resumed.clip(), first.clip());
  EXPECT_NE(resumed.clip(), 0.05);  // it moved, so the test can tell
  run(resumed, global, 4, 6);
  EXPECT_EQ(resumed.clip(), straight.clip());
  EXPECT_EQ(global, straight_global);
}

TEST(DpFedAvgTest, AdaptiveClippingWithoutBudgetForTheSumIsRefused) {
  // σ_b = 0.05 · 10 = 0.5: z = 1 needs 2σ_b > 1.
  auto dp = MakeDp({.noise_multiplier = 1.0, .clip = 1.0, .adaptive = true, .seed = 1});
  std::vector<float> global(2, 0.0f);
  dp->PlanRound(10);
  const Status begun = dp->Begin(1, global);
  EXPECT_EQ(begun.code(), Code::kFailedPrecondition);
  EXPECT_NE(begun.message().find("dp_clipped_count_stddev"), std::string::npos) << begun.message();
}

// A LoRA federation: what is clipped and noised is how far a site moved the
// global adapter, not the factors themselves (they would be clipped to C
// however little a site trained), and the merge sees the noised mean moved
// adapter as one upload. Naive merging then sets the global adapter to it;
// the base is untouched.
TEST(DpFedAvgTest, ALoraUploadIsClippedAsItsMoveFromTheGlobalAdapter) {
  models::LoraConfig lora;
  lora.rank = 2;
  lora.alpha = 4;
  lora.target_modules = {"q_proj", "v_proj"};
  auto layout = models::MakeLoraGlobalLayout({.vocab_size = 16, .hidden_size = 8, .intermediate_size = 12,
                                              .num_layers = 1, .num_heads = 2, .num_kv_heads = 1, .max_seq_len = 8},
                                             lora);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  LoraStrategyOptions options{.layout = *layout, .merge = {.rule = LoraMergeRule::kNaive, .rank = 2, .alpha = 4}};
  auto reference = LoraUploadReference(options);
  ASSERT_TRUE(reference.ok()) << reference.status().ToString();
  auto inner = LoraStrategy::Make(options);
  ASSERT_TRUE(inner.ok());
  DpFedAvg dp(std::move(*inner), {.noise_multiplier = kNoNoise, .clip = 1.0, .seed = 1}, *reference);

  std::vector<float> global(layout->global.total_elements);
  for (size_t i = 0; i < global.size(); ++i) global[i] = 0.01f * float(i % 97) - 0.3f;
  const std::vector<float> before = global;
  const Manifest& upload = reference->upload;
  std::vector<float> adapter(global.begin() + layout->adapter_offset(), global.end());
  ASSERT_EQ(adapter.size(), upload.total_elements);  // not frozen-a: the upload is the whole adapter
  std::vector<float> far = adapter, near = adapter;
  far[0] += 6.0f;
  far[1] -= 8.0f;      // moved by norm 10: clipped to 1
  near[2] += 0.5f;     // moved by 0.5: kept
  dp.PlanRound(4);
  ASSERT_TRUE(dp.Begin(1, global).ok());
  ASSERT_TRUE(dp.FoldUpdate("site-far", upload, far, 100).ok());
  ASSERT_TRUE(dp.FoldUpdate("site-near", upload, near, 1).ok());
  ASSERT_TRUE(dp.Finish(global).ok());

  for (size_t i = 0; i < layout->adapter_offset(); ++i) ASSERT_EQ(global[i], before[i]) << "base " << i;
  std::vector<float> expected = adapter;
  expected[0] += 0.6f / 4;
  expected[1] -= 0.8f / 4;
  expected[2] += 0.5f / 4;
  for (size_t i = 0; i < adapter.size(); ++i) {
    EXPECT_NEAR(global[layout->adapter_offset() + i], expected[i], 1e-6) << "adapter " << i;
  }
  EXPECT_EQ(dp.last_round().clipped, 1u);
}

TEST(DpFedAvgTest, ALoraUploadInAnotherLayoutIsRefusedNamingTheSite) {
  models::LoraConfig lora;
  lora.rank = 2;
  lora.alpha = 4;
  lora.target_modules = {"q_proj"};
  auto layout = models::MakeLoraGlobalLayout({.vocab_size = 16, .hidden_size = 8, .intermediate_size = 12,
                                              .num_layers = 1, .num_heads = 2, .num_kv_heads = 1, .max_seq_len = 8},
                                             lora);
  ASSERT_TRUE(layout.ok());
  LoraStrategyOptions options{.layout = *layout, .merge = {.rule = LoraMergeRule::kNaive, .rank = 2, .alpha = 4}};
  auto reference = LoraUploadReference(options);
  ASSERT_TRUE(reference.ok());
  auto inner = LoraStrategy::Make(options);
  ASSERT_TRUE(inner.ok());
  DpFedAvg dp(std::move(*inner), {.noise_multiplier = 1, .clip = 1.0, .seed = 1}, *reference);
  std::vector<float> global(layout->global.total_elements, 0.1f);
  dp.PlanRound(2);
  ASSERT_TRUE(dp.Begin(1, global).ok());
  const Manifest b_only = models::LoraUploadManifest(layout->adapter, true);
  const Status refused = dp.FoldUpdate("site-7", b_only, std::vector<float>(b_only.total_elements, 0.0f), 1);
  EXPECT_EQ(refused.code(), Code::kInvalidArgument);
  EXPECT_NE(refused.message().find("site-7"), std::string::npos) << refused.message();
  EXPECT_EQ(dp.folded(), 0u);
}

}  // namespace
}  // namespace estuary::aggregation
