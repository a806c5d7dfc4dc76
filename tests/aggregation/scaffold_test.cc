// The server's half of SCAFFOLD (aggregation/scaffold.h): its step by hand,
// its refusals, and a restart that continues bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "aggregation/scaffold.h"
#include "aggregation/strategy.h"

namespace estuary::aggregation {
namespace {

std::unique_ptr<Scaffold> Make(uint32_t sites, double server_lr = 1.0) {
  auto made = MakeStrategy({.name = "scaffold", .server_lr = server_lr, .total_sites = sites});
  EXPECT_TRUE(made.ok()) << made.status().ToString();
  return std::unique_ptr<Scaffold>(dynamic_cast<Scaffold*>(made->release()));
}

TEST(Scaffold, StepsTheModelByTheWeightedMeanAndCByTheSumOverN) {
  auto s = Make(4, 0.5);
  const std::vector<float> x0 = {1, -2};
  ASSERT_TRUE(s->Begin(1, x0).ok());
  ASSERT_TRUE(s->FoldControl("a", std::vector<float>{0.4f, 0.8f}, std::vector<float>{1, -1}, 1).ok());
  ASSERT_TRUE(s->FoldControl("b", std::vector<float>{-0.4f, 0}, std::vector<float>{3, 2}, 3).ok());
  std::vector<float> x1(2);
  ASSERT_TRUE(s->Finish(x1).ok());
  EXPECT_FLOAT_EQ(x1[0], 1 + 0.5f * (0.4f - 3 * 0.4f) / 4);
  EXPECT_FLOAT_EQ(x1[1], -2 + 0.5f * 0.8f / 4);
  auto c = s->Control(2);
  ASSERT_TRUE(c.ok());
  EXPECT_FLOAT_EQ((*c)[0], (1 + 3) / 4.0f);
  EXPECT_FLOAT_EQ((*c)[1], (-1 + 2) / 4.0f);
  EXPECT_EQ(s->SaveState().at("c"), *c);
}

TEST(Scaffold, RefusesUpdatesWithoutAGoodControlDeltaAndChangesNothing) {
  auto s = Make(10);
  const std::vector<float> x0 = {1, 2, 3};
  const std::vector<float> delta = {0.1f, 0.2f, 0.3f};
  ASSERT_TRUE(s->Begin(1, x0).ok());
  const Status plain = s->FoldUpdate("site-3", Manifest{}, delta, 5);
  ASSERT_FALSE(plain.ok());
  EXPECT_NE(plain.message().find("site-3"), std::string::npos) << plain.message();
  EXPECT_FALSE(s->Fold(delta, 5).ok());
  EXPECT_FALSE(s->FoldControl("site-3", delta, std::vector<float>{1, 2}, 5).ok());
  EXPECT_FALSE(s->FoldControl("site-3", delta, std::vector<float>{1, NAN, 2}, 5).ok());
  EXPECT_FALSE(s->FoldControl("site-3", std::vector<float>{1, INFINITY, 2}, delta, 5).ok());
  EXPECT_EQ(s->folded(), 0u);
  ASSERT_TRUE(s->FoldControl("site-4", delta, delta, 5).ok());
  std::vector<float> x1(3);
  ASSERT_TRUE(s->Finish(x1).ok());
  auto c = s->Control(3);
  ASSERT_TRUE(c.ok());
  EXPECT_FLOAT_EQ((*c)[2], 0.03f);  // site-4's alone: 0.3 / N
}

TEST(Scaffold, NeedsTheFederationsSiteCount) {
  EXPECT_FALSE(MakeStrategy({.name = "scaffold"}).ok());
  // N is also the population a Poisson-sampled DP-FedAvg divides by: the
  // strategy takes it; the server refuses it where nothing uses it
  // (server/config.h, tests/e2e/secagg_test.cc).
  EXPECT_TRUE(MakeStrategy({.name = "fedavg", .total_sites = 10}).ok());
  EXPECT_EQ(DefaultServerLr("scaffold"), 1.0);
}

// Three rounds straight against two, SaveState, a fresh strategy that loads
// it and the third: the same bits of x and c, as a restarted server.
TEST(Scaffold, SaveLoadContinuesBitForBit) {
  const size_t n = 1000;
  std::mt19937_64 rng(9);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<std::vector<float>> deltas(12, std::vector<float>(n));
  for (auto& d : deltas)
    for (float& x : d) x = normal(rng);
  auto round = [&](Scaffold& s, uint64_t r, std::vector<float>& x) {
    ASSERT_TRUE(s.Begin(r, x).ok());
    ASSERT_TRUE(s.FoldControl("a", deltas[4 * r], deltas[4 * r + 1], 3).ok());
    ASSERT_TRUE(s.FoldControl("b", deltas[4 * r + 2], deltas[4 * r + 3], 7).ok());
    ASSERT_TRUE(s.Finish(x).ok());
  };
  const std::vector<float> x0(n, 0.25f);
  std::vector<float> straight = x0, resumed = x0;
  auto one = Make(6);
  for (uint64_t r = 0; r < 3; ++r) round(*one, r, straight);
  auto before = Make(6);
  for (uint64_t r = 0; r < 2; ++r) round(*before, r, resumed);
  auto after = Make(6);
  ASSERT_TRUE(after->LoadState(before->SaveState()).ok());
  round(*after, 2, resumed);
  EXPECT_EQ(std::memcmp(straight.data(), resumed.data(), n * sizeof(float)), 0);
  EXPECT_EQ(one->SaveState(), after->SaveState());
  EXPECT_NE(one->SaveState().at("c"), std::vector<float>(n, 0.0f));

  EXPECT_FALSE(after->LoadState({{"c", {1, NAN}}}).ok());
  EXPECT_FALSE(after->LoadState({{"m", {1}}}).ok());
  ASSERT_TRUE(after->LoadState({}).ok());
  EXPECT_EQ(*after->Control(n), std::vector<float>(n, 0.0f));
}

}  // namespace
}  // namespace estuary::aggregation
