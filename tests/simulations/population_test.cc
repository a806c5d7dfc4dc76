// A population larger than the training set (--examples-per-client K): its
// runs reproduce from the seed, a round's sites and their examples depend on
// (seed, round, site) only, privacy and straggling run on a million sites,
// loopback agrees with in-process or refuses in one line, and estuary-sim
// holds a million sites in the memory and round time of ten thousand.
#include <gtest/gtest.h>
#include <fmt/format.h>

#include <algorithm>

#include "aggregation/sampling.h"
#include "simulations/poisson_sampling.h"
#include "simulations/population.h"
#include "simulations/runner.h"
#include "tests/e2e/harness.h"
#include "tests/simulations/small_mnist.h"

namespace estuary::simulations {
namespace {

namespace fs = std::filesystem;

// Small(): the MLP, batch 10, seed 11; here 5 local epochs on K = 20 examples a
// site drawn from 600, and `clients` sites.
Scenario Crowd(const fs::path& dir, uint32_t clients, double per_round = 10) {
  Scenario s = Small(dir / "data", dir / "run");
  s.clients = clients;
  s.per_round = per_round;
  s.examples_per_client = 20;
  s.partition = "iid";
  s.task().set_epochs(5);
  return s;
}

class PopulationRun : public ::testing::Test {
 protected:
  void SetUp() override { testing::WriteSyntheticMnist(dir_ / "data", 600, 200, 3); }
  testing::TempDir dir_;
};

TEST_F(PopulationRun, AMillionSitesReproduceFromTheSeedWhateverTheThreads) {
  const Scenario s = Crowd(dir_.path(), 1'000'000, 5);
  auto first = RunInproc(s, nullptr);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = RunInproc(s, nullptr);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  ASSERT_EQ(first->rounds.size(), 3u);
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_EQ(first->rounds[r].clients_selected, 5u);
    EXPECT_EQ(first->rounds[r].updates_received, 5u);
    EXPECT_EQ(first->rounds[r].global_checksum, second->rounds[r].global_checksum) << "round " << r + 1;
  }
  EXPECT_NE(first->rounds[0].global_checksum, first->rounds[1].global_checksum);
  Scenario one_thread = s;
  one_thread.threads = 1;
  auto third = RunInproc(one_thread, nullptr);
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(third->rounds.back().global_checksum, first->rounds.back().global_checksum);
  Scenario other_seed = s;
  other_seed.task().set_seed(12);
  auto fourth = RunInproc(other_seed, nullptr);
  ASSERT_TRUE(fourth.ok());
  EXPECT_NE(fourth->rounds[0].global_checksum, first->rounds[0].global_checksum);
  // Sites of 20 examples each learn: from chance (0.1) towards the easy synthetic digits.
  EXPECT_GT(first->final_accuracy, 0.5) << first->rounds[0].test_accuracy;
}

TEST_F(PopulationRun, ARoundsSitesAndTheirExamplesDependOnSeedRoundAndSiteOnly) {
  auto small = Population::Create(Crowd(dir_.path(), 10'000));
  auto large = Population::Create(Crowd(dir_.path(), 1'000'000));
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  ASSERT_TRUE(large.ok());
  // A site's examples: the same in a population of 10,000 as in one of a million.
  for (uint64_t site : {0, 17, 9'999}) EXPECT_EQ((*small)->Examples(site), (*large)->Examples(site)) << site;
  EXPECT_NE((*large)->Examples(1), (*large)->Examples(2));
  // A round's sites: the server's draw over the names, asked in any order.
  const std::vector<uint64_t> round_3 = (*large)->Sample(3);
  EXPECT_EQ(round_3, aggregation::SampleIndices(1'000'000, 10, 11, 3));
  for (uint64_t round = 1; round <= 3; ++round) (void)(*large)->Sample(round);
  EXPECT_EQ((*large)->Sample(3), round_3);
  EXPECT_NE((*large)->Sample(4), round_3);
  EXPECT_EQ((*large)->Name(42), "client-000042");  // zero-padded: names sort as indices
  EXPECT_EQ((*small)->Name(42), "client-0042");

  // The runner trains those sites: under an attack that changes nothing
  // (scale:1), each round's attackers are the sampled sites Malicious names.
  Scenario s = Crowd(dir_.path(), 1'000'000);
  s.attack = "scale:1";
  s.attackers = 0.3;
  auto attacked = Population::Create(s);
  ASSERT_TRUE(attacked.ok());
  EXPECT_EQ((*attacked)->attackers(), 300'000u);
  auto report = RunInproc(s, nullptr);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->attackers, 300'000u);
  uint64_t total = 0;
  for (const RoundReport& row : report->rounds) {
    uint64_t expected = 0;
    for (uint64_t site : (*attacked)->Sample(row.round)) expected += (*attacked)->Malicious(site);
    EXPECT_EQ(row.attackers, expected) << "round " << row.round;
    total += expected;
  }
  EXPECT_GT(total, 0u);  // 30 sites drawn at 30 %: some attack
}

// --sample-rate over a million sites: the sites of PoissonSampleIndices, and
// distributed DP through SecAgg+ with stragglers among them.
TEST_F(PopulationRun, PoissonSecAggDpAndStragglersRunOnAMillionSites) {
  Scenario s = Crowd(dir_.path(), 1'000'000);
  s.per_round = 10;  // unused under --sample-rate
  s.sample_rate = 8e-6;  // 8 sites a round expected
  s.rounds = 2;
  s.stragglers = 0.5;
  s.secagg = true;
  s.dp = "distributed";
  s.secagg_options.dp.survivors = 0.5;  // a Poisson round may draw fewer than 8: the noise is for 4
  s.federation.mutable_limits()->set_max_norm_over_median(0);
  s.federation.mutable_dp()->set_noise_multiplier(0.5);
  s.federation.mutable_dp()->set_clip(1.0);
  s.federation.mutable_dp()->set_delta(1e-5);
  auto report = RunInproc(s, nullptr);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ASSERT_EQ(report->rounds.size(), 2u);
  for (const RoundReport& row : report->rounds) {
    EXPECT_EQ(row.clients_selected, PoissonSampleIndices(1'000'000, 8e-6, 11, row.round).size()) << row.round;
    EXPECT_EQ(row.updates_received, row.clients_selected);
    EXPECT_TRUE(row.epsilon.has_value());
    EXPECT_TRUE(row.secagg_bytes_per_site.has_value());
  }
  auto again = RunInproc(s, nullptr);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->rounds.back().global_checksum, report->rounds.back().global_checksum);
}

TEST_F(PopulationRun, LoopbackAgreesWithInproc) {
  Scenario s = Crowd(dir_.path(), 40, 4);
  s.rounds = 2;
  s.server_binary = testing::BinaryPath("estuary-server");
  auto inproc = RunInproc(s, nullptr);
  ASSERT_TRUE(inproc.ok()) << inproc.status().ToString();
  s.mode = "loopback";
  auto loopback = RunLoopback(s, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  ASSERT_EQ(loopback->rounds.size(), 2u);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(loopback->rounds[r].updates_received, 4u);
    // The server samples the sites the population does, each holding the same draw; only the fold order differs.
    EXPECT_NEAR(loopback->rounds[r].test_accuracy, inproc->rounds[r].test_accuracy, 0.005) << "round " << r + 1;
    EXPECT_NEAR(loopback->rounds[r].test_loss, inproc->rounds[r].test_loss, 1e-3) << "round " << r + 1;
  }
}

TEST_F(PopulationRun, BadScenariosNameTheProblem) {
  auto fails = [](const Scenario& s) {
    auto report = s.mode == "inproc" ? RunInproc(s, nullptr) : RunLoopback(s, nullptr);
    EXPECT_FALSE(report.ok());
    return report.ok() ? std::string() : report.status().message();
  };
  Scenario loopback = Crowd(dir_.path(), 1'000'000);
  loopback.mode = "loopback";
  EXPECT_NE(fails(loopback).find("connects one agent (a certificate and a TLS connection) per site: 1000000 sites is "
                                 "over its 10000; --mode inproc"),
            std::string::npos);
  Scenario split = Crowd(dir_.path(), 100'000);
  split.examples_per_client = 0;
  EXPECT_NE(fails(split).find("--clients 100000 but " + (dir_ / "data").string() +
                              " has 600 training examples to split among them; give --examples-per-client K"),
            std::string::npos);
  Scenario too_many = Crowd(dir_.path(), 100'000);
  too_many.examples_per_client = 601;
  EXPECT_NE(fails(too_many).find("--examples-per-client 601: the training set has only 600 examples"),
            std::string::npos);
  Scenario text = Crowd(dir_.path(), 100);
  text.task().set_model("llama-tiny");
  EXPECT_NE(fails(text).find("--examples-per-client draws image examples"), std::string::npos);
}

// estuary-sim itself, at 100 sites a round from 10,000 and from 1,000,000:
// the same memory (VmHWM, which the child reports) and the same round time,
// within generous margins for a loaded machine.
TEST_F(PopulationRun, AMillionSitesCostWhatTenThousandDo) {
  auto run = [&](uint32_t clients) {
    const fs::path report = dir_ / fmt::format("sites-{}.json", clients);
    const auto result = testing::RunCommand(fmt::format(
        "{} --quiet --data {} --clients {} --examples-per-client 10 --per-round 100 --rounds 4 --epochs 1 "
        "--batch 10 --threads 2 --report {}",
        testing::BinaryPath("estuary-sim").string(), (dir_ / "data").string(), clients, report.string()));
    EXPECT_EQ(result.exit_code, 0) << result.output;
    return ReadReport(report);
  };
  auto small = run(10'000), large = run(1'000'000);
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  ASSERT_TRUE(large.ok()) << large.status().ToString();
  ASSERT_TRUE(small->peak_rss_bytes && large->peak_rss_bytes);
  auto median_round = [](const Report& r) {
    std::vector<double> seconds;
    for (const RoundReport& row : r.rounds) seconds.push_back(row.seconds);
    std::sort(seconds.begin(), seconds.end());
    return seconds[seconds.size() / 2];
  };
  const double mib = 1 << 20;
  std::printf("10,000 sites: peak RSS %.1f MiB, %.4f s a round; 1,000,000 sites: %.1f MiB, %.4f s a round\n",
              double(*small->peak_rss_bytes) / mib, median_round(*small), double(*large->peak_rss_bytes) / mib,
              median_round(*large));
  EXPECT_LT(*large->peak_rss_bytes, uint64_t(1) << 30);
  // Nothing per site: a hundred times the sites, not 32 MiB more (a byte a site would be 1 MB, a name 20).
  EXPECT_LT(double(*large->peak_rss_bytes), double(*small->peak_rss_bytes) + 32 * mib);
  EXPECT_LT(median_round(*large), 3 * median_round(*small) + 0.05);
}

}  // namespace
}  // namespace estuary::simulations
