// The simulator end to end on a small synthetic federation: reproducibility
// in process, and agreement between the in-process and loopback modes.
#include <gtest/gtest.h>

#include <fstream>

#include "client/compute.h"
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

// The same federation with the clients' MLP on a GPU (fp32): it follows the
// CPU run to rounding.
TEST(Simulation, CudaClientsFollowTheCpuRun) {
  if (auto usable = client::ParseCompute("cuda", "fp32"); !usable.ok()) {
    GTEST_SKIP() << usable.status().message();
  }
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  const Scenario s = Small(dir / "data", dir / "run");
  auto cpu = RunInproc(s, nullptr);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  Scenario gpu = s;
  gpu.device = "cuda";
  auto run = RunInproc(gpu, nullptr);
  ASSERT_TRUE(run.ok()) << run.status().ToString();
  for (size_t r = 0; r < cpu->rounds.size(); ++r) {
    EXPECT_NEAR(run->rounds[r].test_loss, cpu->rounds[r].test_loss, 1e-3 * cpu->rounds[r].test_loss) << r + 1;
    EXPECT_NEAR(run->rounds[r].test_accuracy, cpu->rounds[r].test_accuracy, 0.01) << r + 1;
  }
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

namespace estuary::simulations {
namespace {

// Three topics of distinct, learnable text: each client holds one.
std::filesystem::path WriteTopics(const testing::TempDir& dir) {
  const auto root = dir / "fortunes";
  std::filesystem::create_directories(root);
  const char* lines[] = {"the cat sat on the mat and the cat was happy",
                         "one two three four five six seven eight nine ten",
                         "to be or not to be that is the question"};
  const char* names[] = {"cats", "numbers", "plays"};
  for (int t = 0; t < 3; ++t) {
    std::ofstream out(root / names[t]);
    for (int i = 0; i < 120; ++i) out << lines[t] << " " << i % 7 << "\n%\n";
  }
  return root;
}

Scenario Text(const std::filesystem::path& data) {
  Scenario s;
  s.model = "llama-tiny";
  s.partition = "topic";
  s.data_dir = data;
  s.clients = 3;
  s.per_round = 2;
  s.rounds = 3;
  s.epochs = 1;
  s.batch = 4;
  s.seq_len = 32;
  s.max_local_steps = 4;
  s.eval_windows = 16;
  s.optimizer = "adamw";
  s.lr = 3e-3f;
  s.seed = 5;
  return s;
}

TEST(TextSimulation, OneClientPerTopicLearnsAndIsReproducible) {
  testing::TempDir dir;
  const Scenario s = Text(WriteTopics(dir));
  auto first = RunInproc(s, nullptr);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = RunInproc(s, nullptr);
  ASSERT_TRUE(second.ok());
  ASSERT_EQ(first->rounds.size(), 3u);
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_EQ(first->rounds[r].global_checksum, second->rounds[r].global_checksum) << "round " << r + 1;
  }
  // From ln(256) ~ 5.5 nats per byte at init, held-out loss falls round by round.
  EXPECT_LT(first->rounds[0].test_loss, 5.4);
  EXPECT_LT(first->rounds[2].test_loss, first->rounds[0].test_loss);
  EXPECT_EQ(first->rounds[0].updates_received, 2u);
}

// A real server and one TLS connection per topic: the server builds the same
// decoder from the seed and scores the same held-out text.
TEST(TextSimulation, LoopbackAgreesWithInproc) {
  testing::TempDir dir;
  Scenario s = Text(WriteTopics(dir));
  s.workdir = dir / "run";
  s.server_binary = testing::BinaryPath("estuary-server");
  auto inproc = RunInproc(s, nullptr);
  ASSERT_TRUE(inproc.ok()) << inproc.status().ToString();
  s.mode = "loopback";
  auto loopback = RunLoopback(s, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  ASSERT_EQ(loopback->rounds.size(), inproc->rounds.size());
  for (size_t r = 0; r < inproc->rounds.size(); ++r) {
    EXPECT_EQ(loopback->rounds[r].updates_received, 2u);
    EXPECT_NEAR(loopback->rounds[r].test_loss, inproc->rounds[r].test_loss, 1e-4 * inproc->rounds[r].test_loss)
        << "round " << r + 1;
  }
  EXPECT_FALSE(loopback->round_log.empty());
}

// The same federation with the clients on a GPU: fp32 follows the CPU run
// closely, bf16 within its precision.
TEST(TextSimulation, CudaClientsFollowTheCpuRun) {
  if (auto usable = client::ParseCompute("cuda", "fp32"); !usable.ok()) {
    GTEST_SKIP() << usable.status().message();
  }
  testing::TempDir dir;
  const Scenario s = Text(WriteTopics(dir));
  auto cpu = RunInproc(s, nullptr);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  for (const char* precision : {"fp32", "bf16"}) {
    Scenario gpu = s;
    gpu.device = "cuda";
    gpu.precision = precision;
    auto run = RunInproc(gpu, nullptr);
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    const double tolerance = std::string(precision) == "fp32" ? 1e-3 : 2e-2;
    for (size_t r = 0; r < cpu->rounds.size(); ++r) {
      EXPECT_NEAR(run->rounds[r].test_loss, cpu->rounds[r].test_loss, tolerance * cpu->rounds[r].test_loss)
          << precision << " round " << r + 1;
    }
  }
}

TEST(TextSimulation, BadScenariosNameTheProblem) {
  testing::TempDir dir;
  const auto data = WriteTopics(dir);
  Scenario too_many = Text(data);
  too_many.clients = 4;
  auto r = RunInproc(too_many, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("3 topics"), std::string::npos) << r.status().message();
  Scenario iid = Text(data);
  iid.partition = "iid";
  r = RunInproc(iid, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--partition topic"), std::string::npos) << r.status().message();
  Scenario optimizer = Text(data);
  optimizer.optimizer = "adagrad";
  r = RunInproc(optimizer, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("adagrad"), std::string::npos) << r.status().message();
  Scenario half_on_cpu = Text(data);
  half_on_cpu.precision = "bf16";
  r = RunInproc(half_on_cpu, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("CPU backend trains in fp32"), std::string::npos) << r.status().message();
  Scenario no_such_device = Text(data);
  no_such_device.device = "tpu";
  r = RunInproc(no_such_device, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("'tpu'"), std::string::npos) << r.status().message();
  no_such_device.device = "cuda:x";
  r = RunInproc(no_such_device, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cuda:x"), std::string::npos) << r.status().message();
  Scenario long_windows = Text(data);
  long_windows.seq_len = 4096;
  r = RunInproc(long_windows, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("4096"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace estuary::simulations
