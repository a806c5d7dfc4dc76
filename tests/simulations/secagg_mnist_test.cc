// FedAvg through SecAgg+ in the simulator, on the real MNIST files
// (scripts/fetch-mnist): the protocol's mean is the plain mean within the
// quantisation bound, a run reaches the plain run's accuracy, sites dropping
// out at random stages do not stop a round, and what cannot work together
// is refused in one line.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "simulations/report.h"
#include "simulations/runner.h"
#include "tests/e2e/harness.h"

namespace estuary::simulations {
namespace {

namespace fs = std::filesystem;

// As robust_mnist_test: ESTUARY_MNIST or the source tree's data/mnist;
// missing data fails the test.
fs::path MnistDir() {
  if (const char* given = std::getenv("ESTUARY_MNIST")) return given;
  return fs::path(ESTUARY_SOURCE_DIR) / "data" / "mnist";
}

#define REQUIRE_MNIST()                                                                                      \
  if (!fs::exists(MnistDir() / "train-images-idx3-ubyte")) {                                                 \
    FAIL() << "no MNIST at " << MnistDir() << " (scripts/fetch-mnist data/mnist; or set ESTUARY_MNIST)"; \
  }

// 20 sites, 10 a round (of 8000 training images), 5 local epochs.
Scenario Mnist(uint64_t rounds) {
  Scenario s;
  s.clients = 20;
  s.per_round = 10;
  s.rounds = rounds;
  s.data_dir = MnistDir();
  s.task().set_seed(5);
  return s;
}

TEST(SecAggSimulation, OneRoundEqualsPlainFedAvgWithinTheQuantisationBound) {
  REQUIRE_MNIST();
  Scenario plain = Mnist(1);
  plain.task().set_epochs(1);  // exactness needs no accuracy
  std::vector<float> plain_global;
  auto plain_report = RunInproc(plain, nullptr, &plain_global);
  ASSERT_TRUE(plain_report.ok()) << plain_report.status().ToString();
  for (int neighbours : {0, 6}) {  // the complete graph (k = 9), and SecAgg+'s sparse one
    Scenario secure = plain;
    secure.secagg = true;
    secure.federation.mutable_limits()->set_max_norm_over_median(0);  // as estuary-sim sets it under --secagg
    secure.secagg_options.neighbours = neighbours;
    std::vector<float> secure_global;
    auto secure_report = RunInproc(secure, nullptr, &secure_global);
    ASSERT_TRUE(secure_report.ok()) << secure_report.status().ToString();
    const RoundReport& row = secure_report->rounds.at(0);
    ASSERT_TRUE(row.secagg_error_bound && row.secagg_bytes_per_site && row.secagg_seconds);
    EXPECT_EQ(row.updates_received, 10u);
    EXPECT_EQ(row.secagg_dropouts, 0u);
    // n / (s · W) with s = floor((2^31 − 1 − n) / (C · W)), C = 100: about
    // n · C / 2^31 = 4.7e-7 per element.
    EXPECT_LT(*row.secagg_error_bound, 5e-7);
    EXPECT_GT(*row.secagg_error_bound, 4e-7);
    // The global models: the same training, the mean through the protocol.
    // Allowed: the bound, plus float rounding of the mean and of the new
    // model (each half an ulp, 2^-24 relative; deltas and weights of this
    // MLP are well under 1 in magnitude).
    ASSERT_EQ(secure_global.size(), plain_global.size());
    double worst = 0, worst_excess = -1;
    for (size_t i = 0; i < plain_global.size(); ++i) {
      const double diff = std::abs(double(secure_global[i]) - double(plain_global[i]));
      const double allowed = *row.secagg_error_bound + std::ldexp(1.0, -22) * (1 + std::abs(plain_global[i]));
      worst = std::max(worst, diff);
      worst_excess = std::max(worst_excess, diff - allowed);
    }
    EXPECT_LE(worst_excess, 0) << "k = " << neighbours << ": worst difference " << worst;
    EXPECT_GT(worst, 0) << "quantisation changed nothing: the comparison proves nothing";
    // Per site (secagg/protocol.h's WireBytes), with k neighbours all
    // present among n = 10: its keys out (68) and k in (4 + 68k), k
    // envelopes out (72 + 168k) and k in (4 + 168k), the masked input
    // (8 + 4d), the survivor set as a bitmap (4 + ⌈n/8⌉) and its in-process
    // signature (12 + 32), the request (4) with its k neighbours' signatures
    // (40k), and k shares back (12 + 70k).
    const uint64_t k = neighbours == 0 ? 9 : neighbours, d = plain_global.size();
    EXPECT_EQ(*row.secagg_bytes_per_site, 68 + (4 + 68 * k) + (72 + 168 * k) + (4 + 168 * k) + (8 + 4 * d) +
                                              (4 + 2) + (12 + 32) + (4 + 40 * k) + (12 + 70 * k));
  }
}

// Through the binary, as a user runs it.
Report RunSim(const testing::TempDir& dir, const std::string& name, const std::string& flags, int expect_exit,
              std::string* output = nullptr) {
  const fs::path report = dir / (name + ".json");
  const auto result = testing::RunCommand(fmt::format(
      "{} --quiet --data {} --clients 20 --per-round 10 --rounds 3 --seed 5 {} --report {}",
      testing::BinaryPath("estuary-sim").string(), MnistDir().string(), flags, report.string()));
  EXPECT_EQ(result.exit_code, expect_exit) << name << "\n" << result.output;
  if (output) *output = result.output;
  if (expect_exit != 0) return {};
  auto read = ReadReport(report);
  EXPECT_TRUE(read.ok()) << name << ": " << read.status().ToString();
  return read.ok() ? *read : Report{};
}

TEST(SecAggSimulation, ReachesThePlainAccuracyAndSurvivesDropouts) {
  REQUIRE_MNIST();
  testing::TempDir dir;
  const Report plain = RunSim(dir, "plain", "", 0);
  std::string output;
  const Report secure = RunSim(dir, "secure", "--secagg", 0, &output);
  ASSERT_EQ(plain.rounds.size(), 3u);
  ASSERT_EQ(secure.rounds.size(), 3u);
  EXPECT_NE(output.find("secure aggregation: "), std::string::npos) << output;
  // Per round the means differ by at most ~5e-7 per element (previous
  // test); three rounds of training on top of that move the accuracy on the
  // 10,000 test images by at most 0.2 percentage points (20 images).
  EXPECT_GT(plain.final_accuracy, 0.8);
  EXPECT_NEAR(secure.final_accuracy, plain.final_accuracy, 0.002);

  const Report dropping = RunSim(dir, "dropout", "--secagg --dropout 0.2", 0);
  ASSERT_EQ(dropping.rounds.size(), 3u) << "every round completes";
  uint64_t dropouts = 0, missing = 0;
  for (const RoundReport& row : dropping.rounds) {
    ASSERT_TRUE(row.secagg_dropouts.has_value());
    dropouts += *row.secagg_dropouts;
    // A site that dropped after sending its input is still in the sum.
    EXPECT_GE(row.updates_received + *row.secagg_dropouts, row.clients_selected);
    missing += row.clients_selected - row.updates_received;
  }
  EXPECT_GT(dropouts, 0u);
  EXPECT_GT(missing, 0u) << "some round lost an input: the mask-key reconstruction ran";
  EXPECT_GT(dropping.final_accuracy, 0.8);
}

TEST(SecAggSimulation, TooFewSurvivorsEndTheRunWithOneLine) {
  REQUIRE_MNIST();
  testing::TempDir dir;
  std::string output;
  RunSim(dir, "gone", "--secagg --dropout 0.9", 1, &output);
  EXPECT_NE(output.find("fewer than the threshold 5: refusing to proceed"), std::string::npos) << output;
}

TEST(SecAggSimulation, CombinationsThatCannotWorkAreRefused) {
  testing::TempDir dir;
  const std::pair<const char*, const char*> cases[] = {
      {"--secagg --strategy median", "sim: --secagg with --strategy median: a robust rule needs the individual updates"},
      {"--secagg --strategy krum", "sim: --secagg with --strategy krum"},
      {"--dropout 0.2 --mode loopback --server 127.0.0.1:7443 --round-log rounds.db",
       "sim: --dropout in loopback mode needs the simulator's own synchronous server"},
      {"--secagg --max-update-norm 5", "sim: --secagg with --max-update-norm or --max-norm-over-median"},
      {"--secagg --max-norm-over-median 10", "sim: --secagg with --max-update-norm or --max-norm-over-median"},
      {"--secagg --dp-noise-multiplier 1", "sim: --secagg with --dp central: DP-FedAvg clips and counts"},
      {"--secagg --mode loopback --server 127.0.0.1:7443 --dp distributed --dp-noise-multiplier 1",
       "sim: --dp distributed with --server: the simulator configures only the server it starts"},
      {"--secagg --secagg-threshold 3 --secagg-neighbours 6",
       "sim: --secagg with 10 sites a round: secagg: threshold 3 with 6 neighbours: must be in [4, 6]"},
      {"--secagg --secagg-neighbours 5", "degree 5 over 10 sites: must be even"},
      {"--secagg --dropout 1", "sim: --dropout 1: must be in [0, 1)"},
  };
  for (const auto& [flags, line] : cases) {
    std::string output;
    RunSim(dir, "refused", flags, 1, &output);
    EXPECT_NE(output.find(line), std::string::npos) << flags << "\n" << output;
  }
}

}  // namespace
}  // namespace estuary::simulations
