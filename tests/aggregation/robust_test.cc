// The Byzantine-robust rules (robust.h) on hand-made inputs, the strategy
// that runs them (robust_strategy.h) and their options' validation.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>

#include <cmath>
#include <limits>
#include <random>

#include "aggregation/federation.h"
#include "aggregation/federation_flags.h"
#include "aggregation/robust.h"
#include "aggregation/robust_strategy.h"

namespace estuary::aggregation {
namespace {

KeptUpdates Updates(const std::vector<std::vector<float>>& rows) {
  KeptUpdates source(rows.at(0).size());
  for (const auto& row : rows) EXPECT_TRUE(source.Add(row).ok());
  return source;
}

TEST(RobustRules, TheMedianOfThreeIgnoresOneOutlierAndAnEvenCountAveragesTheMiddleTwo) {
  std::vector<float> out(2);
  ASSERT_TRUE(CoordinateMedian(Updates({{1, -5}, {1000, -4}, {2, 1e9f}}), out).ok());
  EXPECT_EQ(out, (std::vector<float>{2, -4}));
  ASSERT_TRUE(CoordinateMedian(Updates({{1, 0}, {100, 0}, {3, 1}, {2, 0}}), out).ok());
  EXPECT_EQ(out, (std::vector<float>{2.5f, 0}));
}

TEST(RobustRules, TheTrimmedMeanDropsFloorBetaNFromEachEnd) {
  // n = 5, β = 0.2: one dropped from each end per coordinate.
  const KeptUpdates five = Updates({{1}, {2}, {3}, {4}, {-1000}});
  std::vector<float> out(1);
  ASSERT_TRUE(TrimmedMean(five, 0.2, out).ok());
  EXPECT_FLOAT_EQ(out[0], 2.0f);  // (1 + 2 + 3) / 3
  // β = 0.19: ⌊0.95⌋ = 0, the plain mean, outlier included.
  ASSERT_TRUE(TrimmedMean(five, 0.19, out).ok());
  EXPECT_FLOAT_EQ(out[0], (1 + 2 + 3 + 4 - 1000) / 5.0f);
  for (double beta : {0.5, -0.1, std::nan("")}) {
    const Status refused = TrimmedMean(five, beta, out);
    EXPECT_EQ(refused.code(), Code::kInvalidArgument) << beta;
    EXPECT_NE(refused.message().find("must be in [0, 0.5)"), std::string::npos) << refused.message();
  }
}

// 8 honest updates near one point, 2 far away: Krum picks an honest one,
// Multi-Krum with m = n - f averages exactly the honest ones.
TEST(RobustRules, KrumNeverPicksAnInjectedFarAwayUpdate) {
  std::mt19937 rng(7);
  std::normal_distribution<float> noise(0, 0.1f);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<std::vector<float>> rows(10, std::vector<float>(33));
    std::uniform_int_distribution<size_t> pick(0, 9);
    const size_t bad1 = pick(rng);
    size_t bad2 = pick(rng);
    while (bad2 == bad1) bad2 = pick(rng);
    for (size_t i = 0; i < rows.size(); ++i) {
      for (float& v : rows[i]) v = 1 + noise(rng) + (i == bad1 ? 30.0f : i == bad2 ? -7.0f : 0.0f);
    }
    const KeptUpdates source = Updates(rows);
    auto krum = KrumSelect(source, 2, 1);
    ASSERT_TRUE(krum.ok()) << krum.status().ToString();
    EXPECT_NE((*krum)[0], bad1);
    EXPECT_NE((*krum)[0], bad2);
    auto multi = KrumSelect(source, 2, 8);
    ASSERT_TRUE(multi.ok());
    for (size_t i : *multi) EXPECT_TRUE(i != bad1 && i != bad2) << "trial " << trial << " picked " << i;
    std::vector<float> out(33);
    auto bulyan = Bulyan(Updates(std::vector(rows.begin(), rows.end())), 1, out);  // n = 10 >= 4·1 + 3
    ASSERT_TRUE(bulyan.ok()) << bulyan.status().ToString();
    for (float v : out) EXPECT_NEAR(v, 1.0f, 0.5f);
  }
}

TEST(RobustRules, EachRequirementIsOneLineNamingNAndF) {
  const KeptUpdates six = Updates({{0}, {1}, {2}, {3}, {4}, {5}});
  std::vector<float> out(1);
  auto krum = KrumSelect(six, 2, 1);
  ASSERT_FALSE(krum.ok());
  EXPECT_EQ(krum.status().message(), "robust: krum needs n >= 2f + 3 updates: got n = 6 with f = 2");
  auto bulyan = Bulyan(six, 1, out);
  ASSERT_FALSE(bulyan.ok());
  EXPECT_EQ(bulyan.status().message(), "robust: bulyan needs n >= 4f + 3 updates: got n = 6 with f = 1");
  EXPECT_TRUE(KrumSelect(six, 1, 1).ok()) << "6 >= 2·1 + 3";
  auto too_many = KrumSelect(six, 1, 6);
  ASSERT_FALSE(too_many.ok());
  EXPECT_NE(too_many.status().message().find("m in [1, n - f] = [1, 5]"), std::string::npos);
  EXPECT_FALSE(KrumSelect(six, 1, 0).ok());
  std::vector<float> wrong(2);
  EXPECT_NE(CoordinateMedian(six, wrong).message().find("output has 2 values but the updates have 1"),
            std::string::npos);
  EXPECT_FALSE(CoordinateMedian(KeptUpdates(1), out).ok()) << "no updates";
}

TEST(RobustRules, AnUpdateSourceRefusesReadsOutsideIt) {
  const KeptUpdates two = Updates({{1, 2, 3}, {4, 5, 6}});
  std::vector<float> out(2);
  ASSERT_TRUE(two.Read(1, 1, out).ok());
  EXPECT_EQ(out, (std::vector<float>{5, 6}));
  EXPECT_FALSE(two.Read(2, 0, out).ok());
  EXPECT_FALSE(two.Read(0, 2, out).ok());
  KeptUpdates three(3);
  EXPECT_FALSE(three.Add(std::vector<float>{1, 2}).ok());
  EXPECT_EQ(three.count(), 0u);
}

// Keep holds a view and its owner, copying nothing; Add copies.
TEST(RobustRules, KeptUpdatesHoldViewsTheirOwnersKeepAlive) {
  auto staged = std::make_shared<std::vector<float>>(std::vector<float>{7, 8, 9});
  KeptUpdates kept(3);
  ASSERT_TRUE(kept.Keep(staged, *staged).ok());
  ASSERT_TRUE(kept.Add(std::vector<float>{1, 2, 3}).ok());
  EXPECT_EQ(staged.use_count(), 2);
  EXPECT_EQ(kept.copied_floats(), 3u);
  (*staged)[1] = 80;  // a view: the kept update reads the owner's memory
  std::vector<float> out(3);
  ASSERT_TRUE(kept.Read(0, 0, out).ok());
  EXPECT_EQ(out, (std::vector<float>{7, 80, 9}));
  EXPECT_FALSE(kept.Keep(nullptr, *staged).ok()) << "no owner";
  EXPECT_FALSE(kept.Keep(staged, std::span<const float>(*staged).first(2)).ok()) << "wrong size";
  kept.Clear();
  EXPECT_EQ(staged.use_count(), 1);
}

StrategyOptions Robust(const std::string& name) {
  StrategyOptions options;
  options.name = name;
  options.byzantine = 1;
  return options;
}

// global + rule(deltas); weights are checked and then ignored; nothing
// carries from one round to the next.
TEST(RobustStrategy, FinishAddsTheRulesAggregateAndKeepsNothingAcrossRounds) {
  auto made = MakeStrategy(Robust("median"));
  ASSERT_TRUE(made.ok());
  Strategy& median = **made;
  EXPECT_EQ(median.name(), "median");
  std::vector<float> global = {10, 20};
  ASSERT_TRUE(median.Begin(1, global).ok());
  ASSERT_TRUE(median.Fold(std::vector<float>{1, 1}, 1).ok());
  ASSERT_TRUE(median.Fold(std::vector<float>{2, -3}, 1000).ok());  // a huge weight buys nothing
  ASSERT_TRUE(median.Fold(std::vector<float>{500, 2}, 1).ok());
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Status refused = median.Fold(std::vector<float>{nan, 0}, 1);
  EXPECT_EQ(refused.message(), "aggregation: delta[0] is nan (round 1, median)");
  EXPECT_FALSE(median.Fold(std::vector<float>{1}, 1).ok());
  EXPECT_FALSE(median.Fold(std::vector<float>{1, 1}, 0).ok());
  EXPECT_EQ(median.folded(), 3u);
  ASSERT_TRUE(median.Finish(global).ok());
  EXPECT_EQ(global, (std::vector<float>{12, 21}));
  EXPECT_TRUE(median.SaveState().empty());
  EXPECT_FALSE(median.Fold(std::vector<float>{1, 1}, 1).ok()) << "the round is closed";

  ASSERT_TRUE(median.Begin(2, global).ok());
  EXPECT_EQ(median.folded(), 0u);
  EXPECT_FALSE(median.Finish(global).ok()) << "nothing folded";
  ASSERT_TRUE(median.Fold(std::vector<float>{-2, 0}, 1).ok());
  ASSERT_TRUE(median.Finish(global).ok());
  EXPECT_EQ(global, (std::vector<float>{10, 21})) << "round 1's deltas are gone";
}

TEST(RobustStrategy, AKrumRoundWithTooFewUpdatesFailsAndWritesNothing) {
  StrategyOptions options = Robust("krum");
  options.byzantine = 2;
  auto made = MakeStrategy(options);
  ASSERT_TRUE(made.ok());
  auto& krum = dynamic_cast<RobustStrategy&>(**made);
  std::vector<float> global = {0, 0};
  ASSERT_TRUE(krum.Begin(3, global).ok());
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(krum.Fold(std::vector<float>{float(i), 1}, 1).ok());
  const Status short_round = krum.Finish(global);
  EXPECT_EQ(short_round.message(), "robust: krum needs n >= 2f + 3 updates: got n = 6 with f = 2 (round 3, krum)");
  EXPECT_EQ(global, (std::vector<float>{0, 0}));
  ASSERT_TRUE(krum.Fold(std::vector<float>{100, 100}, 1).ok());
  ASSERT_TRUE(krum.Finish(global).ok());
  ASSERT_EQ(krum.last_selection().size(), 1u);
  EXPECT_LT(krum.last_selection()[0], 6u) << "not the far one";
  EXPECT_EQ(global[1], 1.0f);
}

TEST(RobustStrategy, MultiKrumAveragesNMinusFByDefaultAndKrumSelectOtherwise) {
  StrategyOptions options = Robust("multi-krum");
  for (uint32_t m : {0u, 2u}) {
    options.krum_select = m;
    auto made = MakeStrategy(options);
    ASSERT_TRUE(made.ok());
    auto& multi = dynamic_cast<RobustStrategy&>(**made);
    std::vector<float> global = {0};
    ASSERT_TRUE(multi.Begin(1, global).ok());
    for (float v : {1.0f, 1.1f, 0.9f, 1.05f, 50.0f}) ASSERT_TRUE(multi.Fold(std::vector<float>{v}, 1).ok());
    ASSERT_TRUE(multi.Finish(global).ok());
    EXPECT_EQ(multi.last_selection().size(), m == 0 ? 4u : 2u);
    EXPECT_NEAR(global[0], 1.0, 0.06);
  }
}

TEST(RobustStrategy, TheOptionsAreValidatedAndTheFlagsSetThem) {
  StrategyOptions trim = Robust("trimmed-mean");
  trim.trim = 0.5;
  EXPECT_EQ(ValidateStrategyOptions(trim).message(), "aggregation: trim must be in [0, 0.5), got 0.5");
  StrategyOptions select = Robust("krum");
  select.krum_select = 3;
  EXPECT_EQ(ValidateStrategyOptions(select).message(), "aggregation: krum_select = 3 is multi-krum's; krum has none");
  for (const char* name : {"median", "trimmed-mean", "krum", "multi-krum", "bulyan"}) {
    EXPECT_TRUE(ValidateStrategyOptions(Robust(name)).ok()) << name;
    EXPECT_TRUE(IsRobustStrategy(name));
  }
  EXPECT_FALSE(IsRobustStrategy("fedavg"));

  v1::FederationConfig config = DefaultFederation();
  CLI::App app;
  AddFederationFlags(app, &config);
  std::vector<std::string> args = {"--strategy", "multi-krum", "--byzantine", "3", "--krum-select", "4", "--trim",
                                   "0.25"};
  std::reverse(args.begin(), args.end());
  app.parse(args);
  const StrategyOptions parsed = StrategyOptionsOf(config.strategy());
  EXPECT_EQ(parsed.name, "multi-krum");
  EXPECT_EQ(parsed.byzantine, 3u);
  EXPECT_EQ(parsed.krum_select, 4u);
  EXPECT_DOUBLE_EQ(parsed.trim, 0.25);
  EXPECT_TRUE(CheckFederation(config).ok());
  config.mutable_dp()->set_noise_multiplier(1.0);
  EXPECT_NE(CheckFederation(config).message().find("with strategy = multi-krum: DP-FedAvg noises a clipped mean"),
            std::string::npos)
      << CheckFederation(config).message();
}

}  // namespace
}  // namespace estuary::aggregation
