// estuary-sim --mode loopback under Poisson sampling (--sample-rate Q) and
// distributed DP (--secagg --dp distributed): the simulator starts its
// estuary-server as `serve --sample-rate Q --sample-seed SEED --total-sites
// N` and `serve --secagg --dp distributed --dp-survivors F` would be started,
// and each run is held against the in-process run of the same scenario.
//
// What the two modes share, checked equal: the sites each round draws (the
// server's seeded draw is the simulator's PoissonSample), so the counts in
// the report and the round log's participants; the distributed-DP plan
// (scale, share variance) and so every round's ε; and, without noise, the
// committed models bit for bit. What they cannot share: the noise. The
// server's DP-FedAvg noise and a loopback site's noise share and stochastic
// rounding come from RAND_bytes, the in-process ones from the seed, so a
// noised model is checked against its own oracle instead — the plain sum of
// the noised inputs the sites kept over the fixed denominator (distributed),
// and the spread of the released noise over q · N (central).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>

#include "aggregation/sampling.h"
#include "models/checkpoint.h"
#include "privacy/accountant.h"
#include "privacy/distributed_dp.h"
#include "privacy/poisson_plan.h"
#include "server/store.h"
#include "simulations/poisson_sampling.h"
#include "simulations/runner.h"
#include "simulations/scenario_checks.h"
#include "tests/e2e/harness.h"
#include "tests/secagg/kept_inputs.h"
#include "tests/simulations/small_mnist.h"

namespace estuary::simulations {
namespace {

namespace fs = std::filesystem;

constexpr uint32_t kSites = 12;         // Small()'s
constexpr uint64_t kMlpElements = 199210;

std::vector<std::string> SiteNames() {
  std::vector<std::string> names;
  for (uint32_t i = 0; i < kSites; ++i) names.push_back(fmt::format("client-{:03}", i));
  return names;
}

// The sites the round log says took part in `round`, sorted.
std::vector<std::string> Participants(server::Store& store, uint64_t round) {
  std::vector<std::string> out;
  auto rows = store.Participations(round);
  EXPECT_TRUE(rows.ok()) << rows.status().ToString();
  if (rows.ok()) {
    for (const server::Participation& p : *rows) out.push_back(p.client);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<float> Checkpoint(server::Store& store, uint64_t round) {
  auto path = store.CheckpointFor(round);
  EXPECT_TRUE(path.ok() && path->has_value()) << "round " << round;
  if (!path.ok() || !path->has_value()) return {};
  auto checkpoint = models::LoadCheckpoint(**path);
  EXPECT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  return checkpoint.ok() ? checkpoint->data : std::vector<float>{};
}

// Small() for two rounds, with the server beside this test.
Scenario TwoRounds(const testing::TempDir& dir) {
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  Scenario s = Small(dir / "data", dir / "run");
  s.rounds = 2;
  s.server_binary = testing::BinaryPath("estuary-server");
  return s;
}

// The same scenario in process, then over TLS, and the loopback run's round log.
struct BothModes {
  Report inproc, loopback;
  std::unique_ptr<server::Store> store;
};

Result<BothModes> RunBothModes(Scenario s) {
  BothModes out;
  ESTUARY_ASSIGN_OR_RETURN(out.inproc, RunInproc(s, nullptr));
  s.mode = "loopback";
  ESTUARY_ASSIGN_OR_RETURN(out.loopback, RunLoopback(s, nullptr));
  if (out.inproc.rounds.size() != 2 || out.loopback.rounds.size() != 2) {
    return Internal("rounds: {} in process, {} over TLS, not 2 each", out.inproc.rounds.size(),
                    out.loopback.rounds.size());
  }
  ESTUARY_ASSIGN_OR_RETURN(out.store, server::Store::OpenReadOnly(out.loopback.round_log));
  return out;
}

// Plain FedAvg at q = 0.3 of 12 sites (seed 11 draws 5 and then 4): the
// server takes inproc's draws, and, folding in double as the simulator does,
// commits its models bit for bit.
TEST(LoopbackSampling, PlainFedAvgTakesTheInprocDrawsAndCommitsItsModels) {
  testing::TempDir dir;
  Scenario s = TwoRounds(dir);
  s.sample_rate = 0.3;
  auto both = RunBothModes(s);
  ASSERT_TRUE(both.ok()) << both.status().ToString();
  const Report *inproc = &both->inproc, *loopback = &both->loopback;
  const std::unique_ptr<server::Store>* store = &both->store;
  std::set<size_t> sizes;
  for (uint64_t round = 1; round <= 2; ++round) {
    SCOPED_TRACE(fmt::format("round {}", round));
    const RoundReport &a = inproc->rounds[round - 1], &b = loopback->rounds[round - 1];
    const std::vector<std::string> drawn = PoissonSample(SiteNames(), 0.3, s.task().seed(), round);
    sizes.insert(drawn.size());
    EXPECT_EQ(a.clients_selected, drawn.size());
    EXPECT_EQ(b.clients_selected, drawn.size());
    EXPECT_EQ(b.updates_received, drawn.size());
    EXPECT_EQ(Participants(**store, round), drawn);
    EXPECT_FALSE(a.global_checksum.empty());
    EXPECT_EQ(b.global_checksum, a.global_checksum);
  }
  EXPECT_GT(sizes.size(), 1u) << "both rounds drew as many sites: choose a seed whose Poisson draws differ";
}

// Distributed DP with a fixed number of sites a round (0: --per-round 4) and
// under Poisson sampling (0.5 of 12: the shares planned for the 6 expected,
// --dp-survivors 0.5). Per round: inproc's draw, the plan's scale, the noise
// stddev the round log records, and inproc's ε, which is the accountant's for
// the plan and the inputs summed; round 2's committed model is bit for bit
// the plain aggregate of the noised inputs the sites kept, over the fixed
// denominator (k, or q · N = 6), and their noise shares have the plan's
// variance.
class LoopbackDistributedDp : public ::testing::TestWithParam<double> {};

TEST_P(LoopbackDistributedDp, RunsAsServeWouldAndIsChargedAsInproc) {
  const double q = GetParam();
  constexpr double kZ = 1.0, kDelta = 1e-5;
  testing::TempDir dir;
  Scenario s = TwoRounds(dir);
  s.secagg = true;
  s.dp = "distributed";
  s.federation.mutable_limits()->set_max_norm_over_median(0);  // as estuary-sim sets it under --secagg
  s.federation.mutable_dp()->set_noise_multiplier(kZ);
  s.federation.mutable_dp()->set_clip(1.0);
  s.federation.mutable_dp()->set_delta(kDelta);
  if (q > 0) {
    s.sample_rate = q;
    s.secagg_options.dp.survivors = 0.5;
  }
  const uint64_t seed = s.task().seed();
  auto inproc = RunInproc(s, nullptr);
  ASSERT_TRUE(inproc.ok()) << inproc.status().ToString();
  s.mode = "loopback";
  s.secagg_keep_dir = dir / "kept";
  fs::create_directories(s.secagg_keep_dir);
  auto loopback = RunLoopback(s, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  ASSERT_EQ(loopback->rounds.size(), 2u);
  ASSERT_EQ(inproc->rounds.size(), 2u);

  const double per_round = double(s.per_round);
  const double denominator = q > 0 ? q * kSites : per_round;
  privacy::DistributedDpOptions options{
      .noise_multiplier = kZ, .clip = 1, .survivors = s.secagg_options.dp.survivors, .denominator = denominator};
  if (q > 0) {
    options.expected_sites = denominator;
    options.max_sites = privacy::PoissonPlannedMaximum(kSites, q);
  }
  auto planned = privacy::PlanDistributedDpShares(options, 32, uint32_t(per_round), kMlpElements);
  ASSERT_TRUE(planned.ok()) << planned.status().ToString();
  const privacy::DistributedDpPlan plan = *planned;
  auto accountant = privacy::Accountant::Create(kDelta);
  ASSERT_TRUE(accountant.ok());
  auto store = server::Store::OpenReadOnly(loopback->round_log);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  for (uint64_t round = 1; round <= 2; ++round) {
    SCOPED_TRACE(fmt::format("round {}", round));
    const RoundReport &a = inproc->rounds[round - 1], &b = loopback->rounds[round - 1];
    std::vector<std::string> drawn = q > 0 ? PoissonSample(SiteNames(), q, seed, round)
                                           : aggregation::SampleClients(SiteNames(), size_t(per_round), seed, round);
    std::sort(drawn.begin(), drawn.end());
    const uint32_t n = uint32_t(drawn.size());
    ASSERT_GE(n, plan.min_included) << "this seed's draw is below the plan: the round would fail";
    EXPECT_EQ(a.clients_selected, n);
    EXPECT_EQ(b.clients_selected, n);
    EXPECT_EQ(a.updates_received, n);
    EXPECT_EQ(b.updates_received, n);  // every input in the sum
    EXPECT_EQ(Participants(**store, round), drawn);

    auto logged = (*store)->GetRound(round);
    ASSERT_TRUE(logged.ok() && logged->has_value());
    const server::RoundRecord& r = **logged;
    ASSERT_EQ(r.state, server::RoundState::kCommitted) << r.detail;
    ASSERT_TRUE(r.secagg.has_value());
    EXPECT_EQ(r.secagg->scale, plan.scale);
    ASSERT_TRUE(r.privacy.has_value());
    const double rate = q > 0 ? q : per_round / kSites;
    EXPECT_EQ(r.privacy->sampling_rate, rate);
    EXPECT_NEAR(r.privacy->noise_stddev, std::sqrt(double(n) * double(plan.site_variance)) / plan.scale, 1e-9);

    auto rdp = privacy::DistributedDpRoundRdp(plan, n, rate, accountant->orders());
    ASSERT_TRUE(rdp.ok()) << rdp.status().ToString();
    ASSERT_TRUE(accountant->AddRoundRdp(*rdp).ok());
    const double epsilon = accountant->Spent().epsilon;
    ASSERT_TRUE(a.epsilon && b.epsilon);
    EXPECT_NEAR(*b.epsilon, epsilon, 1e-9 * epsilon);
    EXPECT_NEAR(*b.epsilon, *a.epsilon, 1e-9 * epsilon);
    EXPECT_EQ(b.dp_clip, 1.0);
  }
  ASSERT_TRUE(loopback->epsilon.has_value());
  EXPECT_EQ(*loopback->epsilon, *loopback->rounds.back().epsilon);

  // Round 2 (round 1's previous model is the initial one, not a checkpoint).
  const std::vector<testing::Contribution> noised = testing::KeptInputs(s.secagg_keep_dir, 2);
  const std::vector<testing::Contribution> shares = testing::KeptInputs(s.secagg_keep_dir, 2, ".noise");
  ASSERT_EQ(noised.size(), loopback->rounds[1].updates_received);
  ASSERT_EQ(shares.size(), noised.size());
  const std::vector<float> committed = Checkpoint(**store, 2);
  const std::vector<float> expected =
      testing::PlainAggregate(noised, 1, plan.scale, Checkpoint(**store, 1), 2, q > 0 ? denominator : 0);
  ASSERT_EQ(committed.size(), expected.size());
  EXPECT_EQ(std::memcmp(committed.data(), expected.data(), expected.size() * sizeof(float)), 0)
      << "the committed model is not the noised inputs' aggregate over " << denominator;
  // The noise in the sum: n shares of N_Z(0, V) an element; the sample
  // variance of d of them has relative standard error √(2/d) = 0.32 %.
  double squares = 0;
  for (size_t i = 0; i < kMlpElements; ++i) {
    int64_t total = 0;
    for (const testing::Contribution& share : shares) total += int32_t(share.quantized.at(i));
    squares += double(total) * double(total);
  }
  const double target = double(shares.size()) * double(plan.site_variance);
  EXPECT_NEAR(squares / double(kMlpElements) / target, 1.0, 6 * std::sqrt(2.0 / double(kMlpElements)));
}

INSTANTIATE_TEST_SUITE_P(Sampling, LoopbackDistributedDp, ::testing::Values(0.0, 0.5),
                         [](const auto& info) { return info.param > 0 ? std::string("Poisson") : std::string("Fixed"); });

// Central DP (DP-FedAvg on the server) under Poisson sampling, q = 0.5 of 12.
// The sites train at a learning rate of 1e-30, so a round's change to the
// model is the released noise alone: z·C·N(0, 1) over the denominator. Over
// the 199,210 weights its RMS is z·C / (q · N) = 1/6 within 1 % (its standard
// error is 0.16 %) — not 1/k for the k drawn (seed 11's round 2: 7, 14 %
// off) — so the server divides as
// inproc does, by the expected count; ε is the accountant's at q = 0.5, as
// inproc's, and the same sites are drawn.
TEST(LoopbackSampling, CentralDpDividesByTheExpectedCountAndIsChargedAsInproc) {
  constexpr double kQ = 0.5, kZ = 1.0, kDelta = 1e-5;
  testing::TempDir dir;
  Scenario s = TwoRounds(dir);
  s.sample_rate = kQ;
  s.task().set_learning_rate(1e-30f);
  s.federation.mutable_dp()->set_noise_multiplier(kZ);
  s.federation.mutable_dp()->set_clip(1.0);
  s.federation.mutable_dp()->set_delta(kDelta);
  auto both = RunBothModes(s);
  ASSERT_TRUE(both.ok()) << both.status().ToString();
  const Report *inproc = &both->inproc, *loopback = &both->loopback;
  const std::unique_ptr<server::Store>* store = &both->store;
  auto accountant = privacy::Accountant::Create(kDelta);
  ASSERT_TRUE(accountant.ok());
  for (uint64_t round = 1; round <= 2; ++round) {
    SCOPED_TRACE(fmt::format("round {}", round));
    const RoundReport &a = inproc->rounds[round - 1], &b = loopback->rounds[round - 1];
    const std::vector<std::string> drawn = PoissonSample(SiteNames(), kQ, s.task().seed(), round);
    EXPECT_EQ(a.clients_selected, drawn.size());
    EXPECT_EQ(b.clients_selected, drawn.size());
    EXPECT_EQ(Participants(**store, round), drawn);
    auto logged = (*store)->GetRound(round);
    ASSERT_TRUE(logged.ok() && logged->has_value() && (**logged).privacy.has_value());
    const server::RoundPrivacy& p = *(**logged).privacy;
    EXPECT_EQ(p.sampling_rate, kQ);
    EXPECT_EQ(p.noise_stddev, kZ * 1.0);  // on the sum
    ASSERT_TRUE(accountant->AddRounds(kQ, kZ).ok());
    const double epsilon = accountant->Spent().epsilon;
    ASSERT_TRUE(a.epsilon && b.epsilon);
    EXPECT_NEAR(*b.epsilon, epsilon, 1e-9 * epsilon);
    EXPECT_NEAR(*b.epsilon, *a.epsilon, 1e-9 * epsilon);
  }
  const uint32_t k = loopback->rounds[1].clients_selected;
  ASSERT_NE(k, 6u) << "this seed's round 2 draws q · N sites: choose one where the two denominators differ";
  const std::vector<float> before = Checkpoint(**store, 1), after = Checkpoint(**store, 2);
  ASSERT_EQ(before.size(), kMlpElements);
  ASSERT_EQ(after.size(), kMlpElements);
  double squares = 0;
  for (size_t i = 0; i < kMlpElements; ++i) {
    const double change = double(after[i]) - double(before[i]);
    squares += change * change;
  }
  const double rms = std::sqrt(squares / double(kMlpElements));
  EXPECT_NEAR(rms * kQ * kSites / kZ, 1.0, 0.01) << "RMS " << rms << "; 1/k would be " << 1.0 / k;
}

// What loopback still cannot run: a server it attaches to samples and noises
// as it was started, and asynchronous sites are not drawn by rounds.
TEST(LoopbackSampling, WhatStillCannotRunIsRefusedInOneLine) {
  Scenario s;
  s.mode = "loopback";
  s.server = "127.0.0.1:7443";
  s.sample_rate = 0.5;
  EXPECT_EQ(CheckScenario(s).message(),
            "sim: --sample-rate with --server: the simulator configures only the server it starts; one it attaches "
            "to samples as it was started (serve --sample-rate Q --total-sites N)");
  s.sample_rate = 0;
  s.secagg = true;
  s.dp = "distributed";
  s.federation.mutable_limits()->set_max_norm_over_median(0);
  s.federation.mutable_dp()->set_noise_multiplier(1);
  EXPECT_EQ(CheckScenario(s).message(),
            "sim: --dp distributed with --server: the simulator configures only the server it starts; one it "
            "attaches to noises as it was started (serve --secagg --dp distributed)");
  Scenario async;
  async.mode = "loopback";
  async.async = true;
  async.sample_rate = 0.5;
  async.per_round = 1;
  EXPECT_EQ(RunLoopback(async, nullptr).status().message(),
            "sim: --async with --sample-rate: sites are drawn as slots free up");
}

}  // namespace
}  // namespace estuary::simulations
