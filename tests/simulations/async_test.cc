// Asynchronous rounds in the simulator (simulations/async_runner.h): the
// simulated clock, staleness and its refusal, reproducibility whatever the
// threads, and the combinations --async refuses. FedBuff's arithmetic is
// checked against the paper in aggregation_fedbuff_oracle_test.
#include "simulations/async_runner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>

#include "server/store.h"
#include "simulations/stragglers.h"
#include "tests/e2e/harness.h"
#include "tests/simulations/small_mnist.h"

namespace estuary::simulations {
namespace {

Scenario AsyncSmall(const std::filesystem::path& dir) {
  Scenario s = Small(dir / "data", dir / "run");
  s.async = true;
  s.rounds = 6;
  s.buffer = 3;
  s.concurrency = 5;
  s.staleness_weight = "poly:0.5";
  return s;
}

// 600 examples on 12 shards: 50 a site, 5 steps of 10 an epoch.
constexpr double kFullSteps = 5;

// Without stragglers and with C = K every site starts on the same version
// and arrives with the others: each version is one full site's work later,
// nothing is stale, and the synchronous clock agrees.
TEST(Async, TheClockOfEqualSitesIsOneLocalWorkAVersion) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  Scenario s = AsyncSmall(dir.path());
  s.concurrency = s.buffer = 4;
  auto run = RunAsync(s, nullptr);
  ASSERT_TRUE(run.ok()) << run.status().ToString();
  ASSERT_EQ(run->rounds.size(), 6u);
  for (const RoundReport& row : run->rounds) {
    EXPECT_EQ(*row.sim_time, kFullSteps * double(row.round));
    EXPECT_EQ(*row.staleness_max, 0u);
    EXPECT_EQ(row.updates_received, 4u);
  }
  EXPECT_EQ(run->mode, "inproc-async");
  s.async = false;
  s.stragglers = 0.5;  // synchronous: a straggler's partial work ends at the others' deadline
  s.straggler_work = "0.2:0.2";
  auto sync = RunInproc(s, nullptr);
  ASSERT_TRUE(sync.ok()) << sync.status().ToString();
  for (const RoundReport& row : sync->rounds) EXPECT_EQ(*row.sim_time, kFullSteps * double(row.round));
}

// Five-times-slower stragglers arrive late: their updates are stale, each
// version still folds K, a limit on staleness refuses some, and the run is
// the same bits with one thread or three.
TEST(Async, StragglersMakeStaleUpdatesAndTheRunReproducesWhateverTheThreads) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  Scenario s = AsyncSmall(dir.path());
  s.stragglers = 0.3;
  s.straggler_work = "0.2:0.2";
  s.threads = 1;
  auto one = RunAsync(s, nullptr);
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  s.threads = 3;
  auto three = RunAsync(s, nullptr);
  ASSERT_TRUE(three.ok()) << three.status().ToString();
  ASSERT_EQ(one->rounds.size(), 6u);
  uint64_t stale = 0;
  double last = 0;
  for (size_t v = 0; v < 6; ++v) {
    const RoundReport& row = one->rounds[v];
    EXPECT_EQ(row.global_checksum, three->rounds[v].global_checksum) << "version " << v + 1;
    EXPECT_EQ(row.sim_time, three->rounds[v].sim_time);
    EXPECT_EQ(row.updates_received, 3u);
    EXPECT_GT(*row.sim_time, last);
    last = *row.sim_time;
    stale = std::max(stale, *row.staleness_max);
  }
  // A straggler's job is 25 time units; the fast sites make a version about every 5 / (C / K).
  EXPECT_GE(stale, 2u);
  EXPECT_LT(one->rounds.back().test_loss, one->rounds.front().test_loss) << "it learns";

  s.max_staleness = 1;
  auto limited = RunAsync(s, nullptr);
  ASSERT_TRUE(limited.ok()) << limited.status().ToString();
  uint64_t refused = 0;
  for (const RoundReport& row : limited->rounds) {
    EXPECT_LE(*row.staleness_max, 1u);
    EXPECT_EQ(row.updates_received, 3u);
    refused += *row.updates_refused;
  }
  EXPECT_GT(refused, 0u);
  EXPECT_NE(limited->rounds.back().global_checksum, one->rounds.back().global_checksum);

  s.max_staleness = -1;
  s.task().set_seed(12);
  auto other = RunAsync(s, nullptr);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->rounds.back().global_checksum, one->rounds.back().global_checksum);
}

// The server lr scales the buffered mean; a lr of 1 and the constant weight
// make different models than 0.5 and poly (the weight matters only when stale).
TEST(Async, TheServerLrAndTheStalenessWeightChangeTheModel) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  Scenario s = AsyncSmall(dir.path());
  s.stragglers = 0.3;
  s.straggler_work = "0.2:0.2";
  auto poly = RunAsync(s, nullptr);
  ASSERT_TRUE(poly.ok()) << poly.status().ToString();
  s.staleness_weight = "constant";
  auto constant = RunAsync(s, nullptr);
  ASSERT_TRUE(constant.ok());
  EXPECT_EQ(constant->rounds[0].global_checksum, poly->rounds[0].global_checksum) << "version 1: nothing is stale";
  ASSERT_EQ(poly->rounds.size(), 6u);
  EXPECT_GT(*poly->rounds[5].staleness_max, 0u);
  EXPECT_NE(constant->rounds[5].global_checksum, poly->rounds[5].global_checksum);
  s.federation.mutable_strategy()->set_server_lr(0.5);
  auto half = RunAsync(s, nullptr);
  ASSERT_TRUE(half.ok());
  EXPECT_NE(half->rounds[0].global_checksum, constant->rounds[0].global_checksum);
}

TEST(Async, RefusesWhatAsynchronousRoundsCannotRunInOneLine) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  auto refused = [&](const std::function<void(Scenario&)>& change, const std::string& expected) {
    Scenario s = AsyncSmall(dir.path());
    change(s);
    auto run = RunAsync(s, nullptr);
    ASSERT_FALSE(run.ok()) << expected;
    EXPECT_NE(run.status().message().find(expected), std::string::npos) << run.status().message();
    EXPECT_EQ(run.status().message().find('\n'), std::string::npos);
  };
  refused([](Scenario& s) { s.mode = "loopback"; s.stragglers = 0.3; }, "--async --mode loopback with --stragglers");
  refused([](Scenario& s) { s.mode = "loopback"; }, "RunAsync runs in process");
  refused([](Scenario& s) { s.secagg = true; }, "--async with --secagg");
  refused([](Scenario& s) { s.federation.mutable_strategy()->set_name("scaffold"); }, "strategy scaffold");
  refused([](Scenario& s) { s.federation.mutable_strategy()->set_name("fednova"); }, "strategy fednova");
  refused([](Scenario& s) { s.federation.mutable_strategy()->set_name("median"); },
          "a robust rule needs a whole round");
  refused([](Scenario& s) { s.federation.mutable_strategy()->set_name("krum"); }, "strategy krum");
  refused([](Scenario& s) { s.concurrency = 13; }, "--concurrency 13");
  refused([](Scenario& s) { s.buffer = 0; }, "--buffer 0");
  refused([](Scenario& s) { s.staleness_weight = "poly:-1"; }, "staleness weight 'poly:-1'");
  refused([](Scenario& s) { s.sample_rate = 0.5; }, "--sample-rate");
}

// Over real TLS the server runs FedBuff: each version folds K arrivals,
// weighted by their staleness as the round log records it, the report's rows
// are the round log's versions, the sites stop when the federation
// completes, and the model learns.
TEST(Async, LoopbackRunsTheServersAsynchronousRounds) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  const Scenario s = AsyncSmall(dir.path());
  Scenario over_tls = s;
  over_tls.mode = "loopback";
  auto run = RunLoopback(over_tls, nullptr);
  ASSERT_TRUE(run.ok()) << run.status().ToString();
  EXPECT_EQ(run->mode, "loopback-async");
  ASSERT_EQ(run->rounds.size(), 6u);
  auto store = server::Store::OpenReadOnly(run->round_log);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  for (size_t i = 0; i < run->rounds.size(); ++i) {
    const RoundReport& row = run->rounds[i];
    EXPECT_EQ(row.round, i + 1);
    EXPECT_EQ(row.updates_received, 3u) << "version " << row.round;
    auto arrivals = (*store)->Arrivals(row.round);
    ASSERT_TRUE(arrivals.ok());
    uint64_t folded = 0, largest = 0;
    for (const server::Arrival& a : *arrivals) {
      if (a.status != "folded") continue;
      ++folded;
      largest = std::max(largest, a.staleness);
      EXPECT_DOUBLE_EQ(a.weight, std::pow(1.0 + double(a.staleness), -0.5)) << a.client;
    }
    EXPECT_EQ(folded, 3u);
    EXPECT_EQ(*row.staleness_max, largest);
    EXPECT_FALSE(row.global_checksum.empty());
  }
  EXPECT_EQ(run->rounds[0].staleness_max, 0u) << "nothing is stale before the first version";
  // Arrivals over the network are not the simulated clock's (a site answered
  // before a version is built is given the old one again), so the bits and
  // the staleness differ from in process; the model still learns.
  EXPECT_GT(run->final_accuracy, run->rounds[0].test_accuracy);
  EXPECT_GT(run->final_accuracy, 0.3);
}

// The flags of one kind of round, given to the other, are refused by the
// binary in one line (nothing runs: no data is read).
TEST(Async, TheBinaryRefusesTheOtherKindOfRoundsFlags) {
  const std::string sim = testing::BinaryPath("estuary-sim").string();
  const auto per_round = testing::RunCommand(sim + " --async --per-round 5 --data /nonexistent");
  EXPECT_NE(per_round.exit_code, 0);
  EXPECT_NE(per_round.output.find("sim: --per-round is for synchronous rounds; --async keeps --concurrency sites "
                                  "training\n"),
            std::string::npos)
      << per_round.output;
  const auto buffer = testing::RunCommand(sim + " --buffer 5 --data /nonexistent");
  EXPECT_NE(buffer.exit_code, 0);
  EXPECT_NE(buffer.output.find("sim: --buffer is for --async\n"), std::string::npos) << buffer.output;
}

}  // namespace
}  // namespace estuary::simulations
