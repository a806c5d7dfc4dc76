// Stragglers in the simulator (simulations/stragglers.h): their share of the
// local work, what a straggling site is told, and whole federations with
// them that reproduce from the seed in both modes.
#include "simulations/stragglers.h"

#include <gtest/gtest.h>

#include <set>

#include "simulations/runner.h"
#include "simulations/scenario_checks.h"
#include "tests/e2e/harness.h"
#include "tests/simulations/small_mnist.h"

namespace estuary::simulations {
namespace {

TEST(Stragglers, BadFlagsAreOneLineNamingTheFlag) {
  EXPECT_EQ(ParseStragglers(1.5, "0.1:0.5").status().message(), "sim: --stragglers 1.5: expected a fraction in [0, 1]");
  for (const char* work : {"0.5", "0:0.5", "0.6:0.5", "0.1:1.5", "a:b", "0.1:", ":0.5"}) {
    EXPECT_EQ(ParseStragglers(0.2, work).status().message(),
              fmt::format("sim: --straggler-work '{}': expected MIN:MAX with 0 < MIN <= MAX <= 1 (fractions of the "
                          "full local steps)",
                          work));
  }
  auto ok = ParseStragglers(0.3, "0.25:0.75");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->fraction, 0.3);
  EXPECT_EQ(ok->min_work, 0.25);
  EXPECT_EQ(ok->max_work, 0.75);
}

// A wall-clock cap would make a run depend on the machine: the simulator
// refuses it and names the reproducible way to the same setting.
TEST(Stragglers, TheSimulatorRefusesAWallClockCapAndNamesStragglersInstead) {
  Scenario s;
  s.federation.mutable_task()->set_max_local_seconds(2);
  for (const char* mode : {"inproc", "loopback"}) {
    s.mode = mode;
    const Status refused = CheckScenario(s);
    EXPECT_NE(refused.message().find("sim: --max-local-seconds 2: a simulation stays reproducible from its seed"),
              std::string::npos)
        << mode << ": " << refused.ToString();
    EXPECT_NE(refused.message().find("--stragglers"), std::string::npos);
  }
}

TEST(Stragglers, AStragglerRunsItsDrawnShareOfTheFullStepsSeededByRoundAndSite) {
  v1::TaskConfig task;
  task.set_epochs(5);
  task.set_batch_size(10);
  EXPECT_EQ(FullLocalSteps(task, 95), 50u);  // 5 epochs of ceil(95 / 10)
  task.set_max_local_steps(30);
  EXPECT_EQ(FullLocalSteps(task, 95), 30u);
  task.set_max_local_steps(0);
  const Stragglers s{.fraction = 0.5, .min_work = 0.2, .max_work = 0.6};
  std::set<uint64_t> seen;
  for (uint64_t round = 1; round <= 20; ++round) {
    const uint64_t steps = StragglerSteps(s, task, 95, 7, round, 3);
    EXPECT_GE(steps, 10u) << round;  // 0.2 x 50
    EXPECT_LE(steps, 30u) << round;  // 0.6 x 50
    EXPECT_EQ(steps, StragglerSteps(s, task, 95, 7, round, 3));
    seen.insert(steps);
  }
  EXPECT_GT(seen.size(), 5u) << "the share is drawn afresh each round";
  EXPECT_NE(StragglerSteps(s, task, 95, 7, 1, 3), StragglerSteps(s, task, 95, 7, 1, 4));
  EXPECT_EQ(StragglerSteps({.fraction = 1, .min_work = 0.01, .max_work = 0.01}, task, 5, 7, 1, 0), 1u)
      << "at least one step";
}

// What the wrapped trainer is given: the task with the straggler's steps.
class RecordingTrainer final : public client::Trainer {
 public:
  explicit RecordingTrainer(uint64_t* steps) : steps_(steps) {}
  uint64_t num_examples() const override { return 95; }
  Result<client::Update> Train(std::span<const float>, const Manifest&, const v1::TaskConfig& task, uint64_t,
                               std::string_view) override {
    *steps_ = task.max_local_steps();
    return InvalidArgument("recorded");
  }

 private:
  uint64_t* steps_;
};

TEST(Stragglers, AStragglingSiteIsToldItsStepsAsTheTasksCap) {
  uint64_t steps = 0;
  const Stragglers s{.fraction = 1, .min_work = 0.2, .max_work = 0.6};
  auto straggler = MakeStraggler(std::make_unique<RecordingTrainer>(&steps), s, 7, 3);
  v1::TaskConfig task;
  task.set_epochs(5);
  task.set_batch_size(10);
  EXPECT_EQ(straggler->num_examples(), 95u);
  EXPECT_FALSE(straggler->Train({}, {}, task, 4, "client-003").ok());
  EXPECT_EQ(steps, StragglerSteps(s, task, 95, 7, 4, 3));
  EXPECT_LT(steps, 50u);
}


// Half the sites straggling changes what the federation learns, the same way
// every run, and over TLS as in process.
TEST(Stragglers, AFederationWithStragglersReproducesAndLoopbackAgrees) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  Scenario s = Small(dir / "data", dir / "run");
  s.task().set_epochs(2);
  auto plain = RunInproc(s, nullptr);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  s.stragglers = 0.5;
  s.straggler_work = "0.2:0.4";
  auto first = RunInproc(s, nullptr);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = RunInproc(s, nullptr);
  ASSERT_TRUE(second.ok());
  ASSERT_EQ(first->rounds.size(), 3u);
  for (size_t r = 0; r < 3; ++r) EXPECT_EQ(first->rounds[r].global_checksum, second->rounds[r].global_checksum);
  EXPECT_NE(first->rounds[2].global_checksum, plain->rounds[2].global_checksum);
  s.mode = "loopback";
  s.server_binary = testing::BinaryPath("estuary-server");
  auto loopback = RunLoopback(s, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  ASSERT_EQ(loopback->rounds.size(), 3u);
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_NEAR(loopback->rounds[r].test_loss, first->rounds[r].test_loss, 1e-3) << "round " << r + 1;
  }
  s.mode = "inproc";
  s.straggler_work = "0.5";
  EXPECT_EQ(RunInproc(s, nullptr).status().message(),
            "sim: --straggler-work '0.5': expected MIN:MAX with 0 < MIN <= MAX <= 1 (fractions of the full local "
            "steps)");
}

// FedNova and SCAFFOLD see a straggler's partial work: FedNova normalises
// by the steps it took (so it is not FedAvg once the steps differ), and a
// straggling SCAFFOLD site corrects its gradients and forms its Δc from its
// own steps (the straggler forwards TrainControlled).
TEST(Stragglers, FedNovaAndScaffoldTakeAStragglersPartialWork) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  Scenario s = Small(dir / "data", dir / "run");
  s.task().set_epochs(2);
  s.rounds = 2;
  s.stragglers = 0.5;
  s.straggler_work = "0.2:0.4";
  auto fedavg = RunInproc(s, nullptr);
  ASSERT_TRUE(fedavg.ok()) << fedavg.status().ToString();
  s.federation.mutable_strategy()->set_name("fednova");
  auto fednova = RunInproc(s, nullptr);
  ASSERT_TRUE(fednova.ok()) << fednova.status().ToString();
  EXPECT_NE(fednova->rounds[0].global_checksum, fedavg->rounds[0].global_checksum);
  s.federation.mutable_strategy()->set_name("scaffold");
  auto scaffold = RunInproc(s, nullptr);
  ASSERT_TRUE(scaffold.ok()) << scaffold.status().ToString();
  EXPECT_EQ(scaffold->rounds[1].updates_received, fedavg->rounds[1].updates_received);
  EXPECT_NE(scaffold->rounds[1].global_checksum, fedavg->rounds[1].global_checksum);
}

}  // namespace
}  // namespace estuary::simulations
