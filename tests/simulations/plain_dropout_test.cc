// estuary-sim --dropout P without --secagg, in both modes: a fraction of each
// round's sampled sites drops out at a stage drawn from the seed and the round
// (simulations/dropout_draw.h) — after training, or mid-upload. In process
// their updates are left out of the fold; over loopback their agents close
// their TLS connections to the real estuary-server there, which records them
// as dropped (a partial upload discarded) and commits the round with the rest.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "aggregation/sampling.h"
#include "server/store.h"
#include "simulations/dropout_draw.h"
#include "simulations/loopback_dropout.h"
#include "simulations/runner.h"
#include "simulations/scenario_checks.h"
#include "tests/e2e/harness.h"
#include "tests/simulations/small_mnist.h"

namespace estuary::simulations {
namespace {

// The draw drops each site with probability P at one of the two stages
// uniformly, the same for the same seed and round, and keeps one site of a
// round it would have emptied.
TEST(PlainDropoutDraw, DropsAboutPAtEitherStageReproduciblyAndKeepsOneSite) {
  constexpr uint32_t kSites = 10;
  constexpr uint64_t kRounds = 4000;
  std::map<SiteDropStage, uint64_t> counts;
  for (uint64_t round = 1; round <= kRounds; ++round) {
    const std::vector<SiteDropStage> drawn = DrawSiteDropouts(0.3, kSites, 7, round);
    ASSERT_EQ(drawn, DrawSiteDropouts(0.3, kSites, 7, round)) << "round " << round;
    for (SiteDropStage d : drawn) ++counts[d];
  }
  const double n = double(kSites * kRounds);
  // Binomial(n, 0.3) and, of those, Binomial(dropped, 0.5): within five standard deviations.
  const double dropped = double(counts[SiteDropStage::kAfterTraining] + counts[SiteDropStage::kMidUpload]);
  EXPECT_NEAR(dropped / n, 0.3, 5 * std::sqrt(0.3 * 0.7 / n));
  EXPECT_NEAR(double(counts[SiteDropStage::kMidUpload]) / dropped, 0.5, 5 * std::sqrt(0.25 / dropped));
  EXPECT_NE(DrawSiteDropouts(0.3, kSites, 7, 1), DrawSiteDropouts(0.3, kSites, 8, 1));
  EXPECT_EQ(CountByStage(DrawSiteDropouts(0, kSites, 7, 1)), (std::vector<uint64_t>{0, 0}));

  // At P = 0.9 three sites would all drop in 73% of rounds: exactly one stays
  // then, each of the three equally often.
  std::map<size_t, uint64_t> kept;
  uint64_t emptied = 0;
  for (uint64_t round = 1; round <= kRounds; ++round) {
    const std::vector<SiteDropStage> drawn = DrawSiteDropouts(0.9, 3, 7, round);
    const std::vector<int> raw = DrawDropStages(0.9, 3, kSiteDropStages, 7, round, "site dropout", false);
    const auto staying = std::count(drawn.begin(), drawn.end(), SiteDropStage::kNone);
    ASSERT_GE(staying, 1) << "round " << round;
    if (std::count(raw.begin(), raw.end(), 0) > 0) {
      for (size_t u = 0; u < 3; ++u) EXPECT_EQ(int(drawn[u]), raw[u]) << "round " << round;
      continue;
    }
    ++emptied;
    ASSERT_EQ(staying, 1) << "round " << round;
    ++kept[size_t(std::find(drawn.begin(), drawn.end(), SiteDropStage::kNone) - drawn.begin())];
  }
  EXPECT_NEAR(double(emptied) / kRounds, 0.729, 5 * std::sqrt(0.729 * 0.271 / kRounds));
  for (size_t u = 0; u < 3; ++u) {
    EXPECT_NEAR(double(kept[u]) / double(emptied), 1.0 / 3, 5 * std::sqrt(2.0 / 9 / double(emptied))) << u;
  }
}

// Small enough for CI: Small()'s 12 sites, 4 a round, 2 rounds, under the
// coordinate-wise median, which does not depend on the order updates arrive
// in, so the two modes commit the same models bit for bit. Seed kSeed draws,
// over the two rounds, a site dropped after training and one mid-upload, and
// leaves each round at least two updates.
constexpr uint64_t kSeed = 30;  // round 1: one after training, one mid-upload; round 2: one mid-upload
constexpr uint64_t kRounds = 2;
constexpr uint32_t kPerRound = 4;

TEST(PlainDropout, BothModesDropTheDrawnSitesAndCommitTheSameModels) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 240, 100, 3);
  Scenario s = Small(dir / "data", dir / "run");
  s.rounds = kRounds;
  s.per_round = kPerRound;
  s.federation.mutable_strategy()->set_name("median");
  s.task().set_seed(kSeed);
  s.dropout = 0.3;
  std::vector<std::vector<uint64_t>> drawn;
  std::vector<uint64_t> total(kSiteDropStages, 0);
  for (uint64_t round = 1; round <= kRounds; ++round) {
    drawn.push_back(CountByStage(DrawSiteDropouts(s.dropout, kPerRound, kSeed, round)));
    ASSERT_LE(drawn.back()[0] + drawn.back()[1], kPerRound - 2) << "round " << round;
    for (int i = 0; i < kSiteDropStages; ++i) total[i] += drawn.back()[i];
  }
  ASSERT_GT(total[0], 0u) << "the seed no longer drops a site after training";
  ASSERT_GT(total[1], 0u) << "the seed no longer drops a site mid-upload";

  Scenario without = s;
  without.dropout = 0;
  auto whole = RunInproc(without, nullptr);
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  auto inproc = RunInproc(s, nullptr);
  ASSERT_TRUE(inproc.ok()) << inproc.status().ToString();
  s.mode = "loopback";
  s.server_binary = testing::BinaryPath("estuary-server");
  ASSERT_TRUE(CheckScenario(s).ok()) << CheckScenario(s).ToString();
  auto loopback = RunLoopback(s, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  ASSERT_EQ(inproc->rounds.size(), kRounds);
  ASSERT_EQ(loopback->rounds.size(), kRounds);

  auto store = server::Store::OpenReadOnly(loopback->round_log);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  bool saw_mid_upload = false;
  for (uint64_t round = 1; round <= kRounds; ++round) {
    const RoundReport &in = inproc->rounds[round - 1], &over = loopback->rounds[round - 1];
    const uint64_t dropped = drawn[round - 1][0] + drawn[round - 1][1];
    EXPECT_EQ(in.dropouts_by_stage, drawn[round - 1]) << "round " << round;
    EXPECT_EQ(over.dropouts_by_stage, drawn[round - 1]) << "round " << round;
    EXPECT_EQ(in.dropouts, dropped);
    EXPECT_EQ(over.dropouts, dropped);
    EXPECT_EQ(in.updates_received, kPerRound - dropped) << "round " << round;
    EXPECT_EQ(over.updates_received, kPerRound - dropped) << "round " << round;
    EXPECT_EQ(over.global_checksum, in.global_checksum) << "round " << round;

    auto logged = (*store)->GetRound(round);
    ASSERT_TRUE(logged.ok() && logged->has_value());
    EXPECT_EQ((*logged)->state, server::RoundState::kCommitted) << (*logged)->detail;
    auto participations = (*store)->Participations(round);
    ASSERT_TRUE(participations.ok());
    for (const server::Participation& p : *participations) {
      if (!std::string_view(p.detail).starts_with(server::kLostMidUpload)) continue;
      saw_mid_upload = true;
      EXPECT_EQ(p.status, "dropped");
      // Half the MLP's delta arrived, and was discarded.
      EXPECT_EQ(p.detail, fmt::format("{}: {} of {} bytes received, discarded", server::kLostMidUpload,
                                      199210 / 2 * 4, 199210 * 4));
    }
  }
  EXPECT_TRUE(saw_mid_upload);
  // The first round that dropped a site folded less than the run without dropouts.
  EXPECT_NE(inproc->rounds[0].global_checksum, whole->rounds[0].global_checksum);
}

TEST(PlainDropout, WhatCannotHonourItIsRefusedInOneLine) {
  Scenario s;
  s.dropout = 1;
  EXPECT_EQ(CheckScenario(s).message(), "sim: --dropout 1: must be in [0, 1)");
  s.dropout = 0.2;
  s.async = true;
  EXPECT_EQ(CheckScenario(s).message(),
            "sim: --dropout with --async: the draw is over a round's sampled sites, and FedBuff's sites train "
            "without rounds (--stragglers makes some of them slow instead)");
  s.async = false;
  s.mode = "loopback";
  s.server = "127.0.0.1:7443";
  EXPECT_EQ(CheckScenario(s).message(),
            "sim: --dropout in loopback mode needs the simulator's own synchronous server (not --async or --server): "
            "it waits for every dropped site to reconnect before sampling a round");
}

}  // namespace
}  // namespace estuary::simulations
