// estuary-sim --secagg --dropout P in loopback mode: the sites' agents drop
// out of the real estuary-server's SecAgg+ over mutual TLS, each at the stage
// inproc's seeded draw gives it. Every round commits; the round log counts
// the dropouts per stage as drawn (and as the inproc run of the same
// scenario counts them); and each committed model is, bit for bit, FedAvg of
// the plain sum of the quantised inputs the surviving sites kept. The two
// modes cannot commit the same model: a site's stochastic rounding draws
// from RAND_bytes over TLS, from the seed in process.
#include <gtest/gtest.h>

#include <cstring>

#include "models/checkpoint.h"
#include "server/store.h"
#include "simulations/loopback_dropout.h"
#include "simulations/runner.h"
#include "simulations/scenario_checks.h"
#include "tests/e2e/harness.h"
#include "tests/secagg/kept_inputs.h"
#include "tests/simulations/small_mnist.h"

namespace estuary::simulations {
namespace {

namespace fs = std::filesystem;

// The counts of DrawSecAggDropouts for a round, by stage.
std::vector<uint64_t> Drawn(double dropout, uint32_t sites, uint64_t seed, uint64_t round) {
  std::vector<uint64_t> counts(kSecAggDropStages, 0);
  for (SecAggDropStage d : DrawSecAggDropouts(dropout, sites, seed, round)) {
    if (d != SecAggDropStage::kNone) ++counts[int(d) - 1];
  }
  return counts;
}

std::vector<float> Checkpoint(server::Store& store, uint64_t round) {
  auto path = store.CheckpointFor(round);
  EXPECT_TRUE(path.ok() && path->has_value());
  if (!path.ok() || !path->has_value()) return {};
  auto checkpoint = models::LoadCheckpoint(**path);
  EXPECT_TRUE(checkpoint.ok());
  return checkpoint.ok() ? checkpoint->data : std::vector<float>{};
}

// Small enough for CI: two rounds (round 2 has a checkpoint before it); ten
// sites, all sampled. At P = 0.3 seed 5 draws three dropouts a round, every
// round keeps the threshold of survivors, and both rounds have a site gone
// after sharing its keys, whose mask key the server rebuilds — in round 2,
// the one compared bit for bit.
constexpr uint32_t kSites = 10;
constexpr uint64_t kRounds = 2;

class LoopbackDropout : public ::testing::TestWithParam<double> {};

TEST_P(LoopbackDropout, EveryRoundCommitsThePlainSumOfTheSurvivorsAndCountsTheDrawnStages) {
  const double dropout = GetParam();
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 240, 100, 3);
  Scenario s = Small(dir / "data", dir / "run");
  s.clients = kSites;
  s.per_round = kSites;  // every site each round: the draw's n is the inproc run's
  s.rounds = kRounds;
  s.secagg = true;
  s.dropout = dropout;
  s.federation.mutable_limits()->set_max_norm_over_median(0);  // as estuary-sim sets it under --secagg
  // The first seed from 5 whose round-2 draw drops a site after it shared
  // its keys, so that the server rebuilds a mask key over TLS.
  uint64_t seed = 5;
  const int after_share = int(SecAggDropStage::kAfterShare) - 1;
  while (dropout > 0 && Drawn(dropout, kSites, seed, 2)[after_share] == 0 && seed < 1000) ++seed;
  ASSERT_GT(dropout > 0 ? Drawn(dropout, kSites, seed, 2)[after_share] : 1u, 0u) << "no seed below 1000 drops one";
  s.task().set_seed(seed);

  auto inproc = RunInproc(s, nullptr);
  ASSERT_TRUE(inproc.ok()) << inproc.status().ToString();

  s.mode = "loopback";
  s.server_binary = testing::BinaryPath("estuary-server");
  s.secagg_keep_dir = dir / "kept";
  fs::create_directories(s.secagg_keep_dir);
  ASSERT_TRUE(CheckScenario(s).ok()) << CheckScenario(s).ToString();
  auto loopback = RunLoopback(s, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  ASSERT_EQ(loopback->rounds.size(), kRounds);
  ASSERT_EQ(inproc->rounds.size(), kRounds);

  auto store = server::Store::OpenReadOnly(loopback->round_log);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  uint64_t total = 0;
  for (uint64_t round = 1; round <= kRounds; ++round) {
    const RoundReport& row = loopback->rounds[round - 1];
    ASSERT_EQ(row.round, round);
    const std::vector<uint64_t> drawn = Drawn(dropout, kSites, seed, round);
    ASSERT_TRUE(row.secagg_dropouts_by_stage.has_value()) << "round " << round;
    EXPECT_EQ(*row.secagg_dropouts_by_stage, drawn) << "round " << round;
    EXPECT_EQ(inproc->rounds[round - 1].secagg_dropouts_by_stage, drawn) << "round " << round;
    const uint64_t dropped = drawn[0] + drawn[1] + drawn[2] + drawn[3];
    total += dropped;
    EXPECT_EQ(row.secagg_dropouts, dropped);
    // Sites gone after their masked input are in the sum.
    EXPECT_EQ(row.updates_received, kSites - drawn[0] - drawn[1] - drawn[2]) << "round " << round;

    auto logged = (*store)->GetRound(round);
    ASSERT_TRUE(logged.ok() && logged->has_value());
    const server::RoundRecord& r = **logged;
    EXPECT_EQ(r.state, server::RoundState::kCommitted) << r.detail;
    ASSERT_TRUE(r.secagg.has_value());
    EXPECT_EQ(r.secagg->stage, "done");
    EXPECT_EQ(DropoutsByDrawnStage(*r.secagg), drawn);
    if (round == 1) continue;  // its previous model is the initial one, not a checkpoint
    const std::vector<testing::Contribution> kept = testing::KeptInputs(s.secagg_keep_dir, round);
    const std::vector<float> expected =
        testing::PlainAggregate(kept, 100, r.secagg->scale, Checkpoint(**store, round - 1), round);
    EXPECT_EQ(kept.size(), row.updates_received) << "round " << round;
    const std::vector<float> committed = Checkpoint(**store, round);
    ASSERT_EQ(committed.size(), expected.size());
    EXPECT_EQ(std::memcmp(committed.data(), expected.data(), expected.size() * sizeof(float)), 0)
        << "round " << round << ": the committed model is not the plain aggregate of the surviving sites' inputs";
  }
  if (dropout == 0) {
    EXPECT_EQ(total, 0u);
  } else {
    EXPECT_GE(total, 1u);  // the seed draws some: the stages are exercised
  }
}

INSTANTIATE_TEST_SUITE_P(Fractions, LoopbackDropout, ::testing::Values(0.0, 0.1, 0.3),
                         [](const auto& info) { return fmt::format("Dropout{}", int(info.param * 100)); });

TEST(LoopbackDropout, WhatStillCannotWorkIsRefusedInOneLine) {
  Scenario s;
  s.mode = "loopback";
  s.secagg = true;
  s.dropout = 1;
  EXPECT_EQ(CheckScenario(s).message(), "sim: --dropout 1: must be in [0, 1)");
  s.dropout = 0.2;
  s.server = "127.0.0.1:7443";
  EXPECT_NE(CheckScenario(s).message().find("sim: --dropout in loopback mode needs the simulator's own synchronous "
                                            "server"),
            std::string::npos)
      << CheckScenario(s).ToString();
}

}  // namespace
}  // namespace estuary::simulations
