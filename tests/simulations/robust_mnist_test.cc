// Byzantine sites end to end: the estuary-sim binary, as a child process,
// federates the MLP over the real MNIST files (scripts/fetch-mnist) with 20%
// of the sites uploading -10 × their delta. FedAvg follows them; the
// coordinate median and Krum do not. A nan attack's updates are refused with
// one line each and the rounds go on.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "simulations/report.h"
#include "tests/e2e/harness.h"

namespace estuary::simulations {
namespace {

namespace fs = std::filesystem;

// As dp_mnist_test: ESTUARY_MNIST or the source tree's data/mnist; missing
// data fails the test.
fs::path MnistDir() {
  if (const char* given = std::getenv("ESTUARY_MNIST")) return given;
  return fs::path(ESTUARY_SOURCE_DIR) / "data" / "mnist";
}

// 20 sites, 10 a round, 3 rounds (of 8000 training images: a few seconds a run).
Report RunSim(const testing::TempDir& dir, const std::string& name, const std::string& flags,
             std::string* output = nullptr) {
  const fs::path mnist = MnistDir();
  const fs::path report = dir / (name + ".json");
  const auto result = testing::RunCommand(fmt::format(
      "{} --quiet --data {} --clients 20 --per-round 10 --rounds 3 {} --report {}",
      testing::BinaryPath("estuary-sim").string(), mnist.string(), flags, report.string()));
  EXPECT_EQ(result.exit_code, 0) << name << "\n" << result.output;
  if (output) *output = result.output;
  auto read = ReadReport(report);
  EXPECT_TRUE(read.ok()) << name << ": " << read.status().ToString();
  return read.ok() ? *read : Report{};
}

TEST(RobustSimulation, SignFlippingSitesRuinFedAvgButNotTheMedianOrKrum) {
  if (!fs::exists(MnistDir() / "train-images-idx3-ubyte")) {
    FAIL() << "no MNIST at " << MnistDir() << " (scripts/fetch-mnist data/mnist; or set ESTUARY_MNIST)";
  }
  testing::TempDir dir;
  const std::string attack = "--attack sign-flip:10 --attackers 0.2";
  const Report fedavg = RunSim(dir, "fedavg", attack);
  const Report median = RunSim(dir, "median", attack + " --strategy median");
  const Report krum = RunSim(dir, "krum", attack + " --strategy krum --byzantine 2");
  ASSERT_EQ(fedavg.rounds.size(), 3u);
  ASSERT_EQ(median.rounds.size(), 3u);
  ASSERT_EQ(krum.rounds.size(), 3u);
  EXPECT_EQ(fedavg.attackers, 4u) << "20% of 20 sites";
  uint64_t sampled_attackers = 0;
  for (const RoundReport& row : fedavg.rounds) {
    ASSERT_TRUE(row.attackers.has_value());
    sampled_attackers += *row.attackers;
    EXPECT_EQ(row.updates_refused, 0u);
  }
  EXPECT_GT(sampled_attackers, 0u) << "an attack no round sampled proves nothing";
  // The same sites are sampled and the same attackers among them under every strategy.
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(median.rounds[i].attackers, fedavg.rounds[i].attackers);
  EXPECT_GT(median.final_accuracy, 0.7);
  EXPECT_GT(krum.final_accuracy, 0.7);
  EXPECT_LT(fedavg.final_accuracy, median.final_accuracy - 0.3);
  EXPECT_LT(fedavg.final_accuracy, krum.final_accuracy - 0.3);
}

TEST(RobustSimulation, NanUpdatesAreRefusedAndTheRoundsGoOn) {
  if (!fs::exists(MnistDir() / "train-images-idx3-ubyte")) {
    FAIL() << "no MNIST at " << MnistDir() << " (scripts/fetch-mnist data/mnist; or set ESTUARY_MNIST)";
  }
  testing::TempDir dir;
  std::string output;
  const Report report = RunSim(dir, "nan", "--attack nan --attackers 0.2 --strategy median", &output);
  EXPECT_NE(output.find("refused: update is not finite (its L2 norm is nan)"), std::string::npos) << output;
  ASSERT_EQ(report.rounds.size(), 3u);
  uint64_t refused = 0;
  for (const RoundReport& row : report.rounds) {
    ASSERT_TRUE(row.attackers.has_value() && row.updates_refused.has_value());
    EXPECT_EQ(*row.updates_refused, *row.attackers) << "round " << row.round;
    EXPECT_EQ(row.updates_received + *row.updates_refused, row.clients_selected);
    refused += *row.updates_refused;
  }
  EXPECT_GT(refused, 0u);
  EXPECT_GT(report.final_accuracy, 0.7);
}

// label-flip: the malicious sites train on l -> 9 - l. With every site
// flipped the model learns the flipped labels (test accuracy far below
// chance's 0.1); with 20% it is counted and the median still learns.
TEST(RobustSimulation, LabelFlippingSitesTrainOnFlippedLabels) {
  if (!fs::exists(MnistDir() / "train-images-idx3-ubyte")) {
    FAIL() << "no MNIST at " << MnistDir() << " (scripts/fetch-mnist data/mnist; or set ESTUARY_MNIST)";
  }
  testing::TempDir dir;
  const Report all = RunSim(dir, "all", "--attack label-flip --attackers 1");
  ASSERT_EQ(all.rounds.size(), 3u);
  EXPECT_EQ(all.attackers, 20u);
  EXPECT_LT(all.final_accuracy, 0.05);
  const Report some = RunSim(dir, "some", "--attack label-flip --attackers 0.2 --strategy median");
  ASSERT_EQ(some.rounds.size(), 3u);
  EXPECT_EQ(some.attackers, 4u);
  EXPECT_GT(some.final_accuracy, 0.7);
}

}  // namespace
}  // namespace estuary::simulations
