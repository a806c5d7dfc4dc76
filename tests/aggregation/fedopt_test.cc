#include "aggregation/fedopt.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <random>

namespace estuary::aggregation {
namespace {

StrategyOptions Adam(bool bias_correction) {
  return {.name = "fedadam", .server_lr = 0.1, .beta1 = 0.9, .beta2 = 0.99, .tau = 1e-3,
          .bias_correction = bias_correction};
}

void ExpectNear(float actual, double expected) {
  EXPECT_LE(std::abs(actual - expected), 1e-6 * std::max(1.0, std::abs(expected))) << actual << " vs " << expected;
}

// Reddi et al.'s update without bias correction, worked by hand:
// round 1, Δ = (0.2, -0.4, 0): m = 0.1 Δ, v = 0.01 Δ², so √v = |m| and
//   x0 = 1 + 0.1 * 0.02 / 0.021 = 1 + 2/21,  x1 = -2 - 0.1 * 0.04 / 0.041 = -2 - 4/41,  x2 unchanged.
// round 2, two clients (weights 1 and 3): Δ = (-0.1, 0, 0.075):
//   m = (0.008, -0.036, 0.0075), v = (0.000496, 0.001584, 5.625e-5)
//   x2 = 0.5 + 0.1 * 0.0075 / (0.0075 + 0.001) = 0.5 + 0.75/8.5.
TEST(FedAdam, DefaultUpdateByHand) {
  FedOpt adam(Adam(false));
  std::vector<float> x = {1.0f, -2.0f, 0.5f};
  ASSERT_TRUE(adam.Begin(1, x).ok());
  ASSERT_TRUE(adam.Fold(std::vector<float>{0.2f, -0.4f, 0.0f}, 10).ok());
  ASSERT_TRUE(adam.Finish(x).ok());
  ExpectNear(x[0], 1.0 + 2.0 / 21.0);
  ExpectNear(x[1], -2.0 - 4.0 / 41.0);
  EXPECT_EQ(x[2], 0.5f);

  ASSERT_TRUE(adam.Begin(2, x).ok());
  ASSERT_TRUE(adam.Fold(std::vector<float>{0.2f, 0.0f, 0.0f}, 1).ok());
  ASSERT_TRUE(adam.Fold(std::vector<float>{-0.2f, 0.0f, 0.1f}, 3).ok());
  ASSERT_TRUE(adam.Finish(x).ok());
  ExpectNear(x[0], 1.1296155618260872);
  ExpectNear(x[1], -2.185797356496271);
  ExpectNear(x[2], 0.5 + 0.75 / 8.5);

  const auto state = adam.SaveState();
  ExpectNear(state.at("m")[2], 0.0075);
  ExpectNear(state.at("v")[2], 5.625e-5);
  EXPECT_EQ(state.at("step"), std::vector<float>{2});
}

// With bias correction the first step is lr * Δ / (|Δ| + τ), about lr * sign(Δ).
TEST(FedAdam, BiasCorrectedFirstStep) {
  FedOpt adam(Adam(true));
  std::vector<float> x = {0.0f, 0.0f};
  ASSERT_TRUE(adam.Begin(1, x).ok());
  ASSERT_TRUE(adam.Fold(std::vector<float>{0.5f, -0.001f}, 1).ok());
  ASSERT_TRUE(adam.Finish(x).ok());
  ExpectNear(x[0], 0.1 * 0.5 / 0.501);
  ExpectNear(x[1], -0.1 * 0.001 / 0.002);
}

std::vector<std::vector<float>> RoundDeltas(size_t rounds, size_t n) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<std::vector<float>> deltas(rounds * 2, std::vector<float>(n));
  for (auto& d : deltas)
    for (float& x : d) x = normal(rng);
  return deltas;
}

void RunRound(Strategy& s, uint64_t round, std::vector<float>& x, const std::vector<std::vector<float>>& deltas) {
  ASSERT_TRUE(s.Begin(round, x).ok());
  ASSERT_TRUE(s.Fold(deltas[2 * round], 3).ok());
  ASSERT_TRUE(s.Fold(deltas[2 * round + 1], 7).ok());
  ASSERT_TRUE(s.Finish(x).ok());
}

// Three rounds straight, against two rounds, SaveState, a fresh strategy
// that loads it, and the third round: the same bits, as a restarted server.
void ExpectSaveLoadContinuesBitForBit(const StrategyOptions& options) {
  const size_t n = 1000;
  const auto deltas = RoundDeltas(3, n);
  const std::vector<float> x0(n, 0.25f);

  std::vector<float> straight = x0;
  auto one = MakeStrategy(options);
  ASSERT_TRUE(one.ok());
  for (uint64_t r = 0; r < 3; ++r) RunRound(**one, r, straight, deltas);

  std::vector<float> resumed = x0;
  auto before = MakeStrategy(options);
  ASSERT_TRUE(before.ok());
  for (uint64_t r = 0; r < 2; ++r) RunRound(**before, r, resumed, deltas);
  const auto saved = (*before)->SaveState();
  ASSERT_FALSE(saved.empty()) << options.name;
  auto after = MakeStrategy(options);
  ASSERT_TRUE(after.ok());
  ASSERT_TRUE((*after)->LoadState(saved).ok());
  RunRound(**after, 2, resumed, deltas);

  EXPECT_EQ(std::memcmp(straight.data(), resumed.data(), n * sizeof(float)), 0) << options.name;
  EXPECT_EQ((*one)->SaveState(), (*after)->SaveState()) << options.name;
  EXPECT_NE(std::memcmp(straight.data(), x0.data(), n * sizeof(float)), 0) << options.name << " never moved";
}

TEST(FedOpt, SaveLoadContinuesBitForBit) {
  ExpectSaveLoadContinuesBitForBit(Adam(false));
  ExpectSaveLoadContinuesBitForBit(Adam(true));
  ExpectSaveLoadContinuesBitForBit({.name = "fedyogi", .server_lr = 0.1, .beta2 = 0.5});
  ExpectSaveLoadContinuesBitForBit({.name = "fedadagrad", .server_lr = 0.1});
  ExpectSaveLoadContinuesBitForBit({.name = "fedavgm", .server_lr = 1.0, .server_momentum = 0.9});
}

// With no momentum and a unit learning rate FedAvgM is FedAvg, to the bit;
// with momentum the second round's step is Δ₂ + β Δ₁.
TEST(FedAvgM, IsFedAvgWithoutMomentumAndAddsTheLastStepWithIt) {
  const size_t n = 500;
  const auto deltas = RoundDeltas(2, n);
  std::vector<float> plain(n, -0.5f), m0(n, -0.5f), m9(n, -0.5f);
  auto fedavg = MakeStrategy({.name = "fedavg"});
  auto no_momentum = MakeStrategy({.name = "fedavgm", .server_lr = 1.0, .server_momentum = 0.0});
  auto momentum = MakeStrategy({.name = "fedavgm", .server_lr = 1.0, .server_momentum = 0.9});
  ASSERT_TRUE(fedavg.ok() && no_momentum.ok() && momentum.ok());
  for (uint64_t r = 0; r < 2; ++r) {
    RunRound(**fedavg, r, plain, deltas);
    RunRound(**no_momentum, r, m0, deltas);
    RunRound(**momentum, r, m9, deltas);
  }
  EXPECT_EQ(std::memcmp(plain.data(), m0.data(), n * sizeof(float)), 0);
  auto mean = [&](size_t round, size_t i) { return (3.0 * deltas[2 * round][i] + 7.0 * deltas[2 * round + 1][i]) / 10; };
  for (size_t i = 0; i < n; ++i) {
    const double expected = -0.5 + mean(0, i) + (0.9 * mean(0, i) + mean(1, i));
    EXPECT_NEAR(m9[i], expected, 1e-6) << i;
  }
  EXPECT_EQ((*momentum)->SaveState().count("momentum"), 1u);
}

TEST(FedAvgM, LoadStateValidates) {
  using State = std::map<std::string, std::vector<float>>;
  for (const State& bad : {State{{"m", {0}}}, State{{"momentum", {0, NAN}}}, State{{"momentum", {0}}, {"v", {0}}}}) {
    auto s = MakeStrategy({.name = "fedavgm"});
    ASSERT_TRUE(s.ok());
    EXPECT_EQ((*s)->LoadState(bad).code(), Code::kInvalidArgument);
    EXPECT_TRUE((*s)->SaveState().empty()) << "untouched";
  }
}

TEST(FedAdam, StateStartsEmptyAndPersists) {
  FedOpt adam(Adam(false));
  EXPECT_TRUE(adam.SaveState().empty());
  std::vector<float> x = {1, 2};
  ASSERT_TRUE(adam.Begin(1, x).ok());
  EXPECT_EQ(adam.Finish(x).code(), Code::kFailedPrecondition);  // nothing folded: no step
  EXPECT_EQ(adam.step(), 0u);
  ASSERT_TRUE(adam.Begin(1, x).ok());
  ASSERT_TRUE(adam.Fold(std::vector<float>{1, -1}, 1).ok());
  ASSERT_TRUE(adam.Finish(x).ok());
  EXPECT_EQ(adam.step(), 1u);
  const auto state = adam.SaveState();
  EXPECT_EQ(state.size(), 3u);
  ExpectNear(state.at("m")[0], 0.1);
  ExpectNear(state.at("v")[1], 0.01);
  // Loading an empty state resets to the start.
  ASSERT_TRUE(adam.LoadState({}).ok());
  EXPECT_TRUE(adam.SaveState().empty());
  EXPECT_EQ(adam.step(), 0u);
}

TEST(FedAdam, LoadStateValidates) {
  using State = std::map<std::string, std::vector<float>>;
  const State good = {{"m", {0, 0}}, {"v", {0, 0}}, {"step", {4}}};
  const std::vector<State> bad = {
      {{"m", {0, 0}}, {"v", {0, 0}}},                                  // no step
      {{"m", {0, 0}}, {"v", {0}}, {"step", {1}}},                      // sizes differ
      {{"m", {0, 0}}, {"v", {0, -1}}, {"step", {1}}},                  // negative v
      {{"m", {0, NAN}}, {"v", {0, 0}}, {"step", {1}}},                 // NaN m
      {{"m", {0, 0}}, {"v", {0, 0}}, {"step", {1.5f}}},                // fractional step
      {{"m", {0, 0}}, {"v", {0, 0}}, {"step", {1, 2}}},                // two steps
      {{"m", {0, 0}}, {"v", {0, 0}}, {"step", {1}}, {"extra", {1}}},  // unknown tensor
  };
  for (const State& state : bad) {
    FedOpt adam(Adam(false));
    EXPECT_EQ(adam.LoadState(state).code(), Code::kInvalidArgument);
    EXPECT_TRUE(adam.SaveState().empty());  // untouched
  }
  FedOpt adam(Adam(false));
  ASSERT_TRUE(adam.LoadState(good).ok());
  EXPECT_EQ(adam.step(), 4u);
  // State for a 2-parameter model does not fit a 3-parameter one.
  EXPECT_EQ(adam.Begin(1, std::vector<float>{1, 2, 3}).code(), Code::kFailedPrecondition);
  ASSERT_TRUE(adam.Begin(1, std::vector<float>{1, 2}).ok());
  EXPECT_EQ(adam.LoadState(good).code(), Code::kFailedPrecondition);  // not mid-round
}

}  // namespace
}  // namespace estuary::aggregation
