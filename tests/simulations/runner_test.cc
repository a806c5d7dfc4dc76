// The simulator end to end on a small synthetic federation: reproducibility
// in process, and agreement between the in-process and loopback modes.
#include <gtest/gtest.h>

#include "simulations/runner.h"
#include "tests/e2e/harness.h"

namespace estuary::simulations {
namespace {

Scenario Small(const std::filesystem::path& data, const std::filesystem::path& workdir) {
  Scenario s;
  s.clients = 12;
  s.per_round = 4;
  s.rounds = 3;
  s.epochs = 1;
  s.batch = 10;
  s.lr = 0.05f;
  s.partition = "shards";
  s.data_dir = data;
  s.workdir = workdir;
  s.seed = 11;
  return s;
}

TEST(Simulation, InprocIsBitwiseReproducibleFromTheSeed) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  const Scenario s = Small(dir / "data", dir / "run");
  auto first = RunInproc(s, nullptr);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = RunInproc(s, nullptr);
  ASSERT_TRUE(second.ok());
  ASSERT_EQ(first->rounds.size(), 3u);
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_EQ(first->rounds[r].global_checksum, second->rounds[r].global_checksum) << "round " << r + 1;
    EXPECT_EQ(first->rounds[r].test_accuracy, second->rounds[r].test_accuracy);
  }
  EXPECT_NE(first->rounds[0].global_checksum, first->rounds[1].global_checksum);
  Scenario other = s;
  other.seed = 12;
  auto third = RunInproc(other, nullptr);
  ASSERT_TRUE(third.ok());
  EXPECT_NE(third->rounds[0].global_checksum, first->rounds[0].global_checksum);
  // A thread count changes the schedule, not the result.
  Scenario one_thread = s;
  one_thread.threads = 1;
  auto fourth = RunInproc(one_thread, nullptr);
  ASSERT_TRUE(fourth.ok());
  EXPECT_EQ(fourth->rounds.back().global_checksum, first->rounds.back().global_checksum);
}

TEST(Simulation, LoopbackAgreesWithInproc) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  Scenario s = Small(dir / "data", dir / "run");
  s.server_binary = testing::BinaryPath("estuary-server");
  auto inproc = RunInproc(s, nullptr);
  ASSERT_TRUE(inproc.ok()) << inproc.status().ToString();
  s.mode = "loopback";
  auto loopback = RunLoopback(s, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  ASSERT_EQ(loopback->rounds.size(), 3u);
  EXPECT_FALSE(loopback->round_log.empty());
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_EQ(loopback->rounds[r].clients_selected, 4u);
    EXPECT_EQ(loopback->rounds[r].updates_received, 4u);
    // Same clients, same data, same init: only the fold order differs.
    EXPECT_NEAR(loopback->rounds[r].test_accuracy, inproc->rounds[r].test_accuracy, 0.005) << "round " << r + 1;
    EXPECT_NEAR(loopback->rounds[r].test_loss, inproc->rounds[r].test_loss, 1e-3);
  }
}

}  // namespace
}  // namespace estuary::simulations
