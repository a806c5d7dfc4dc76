// Federated evaluation in the simulator (docs/EVALUATION.md): the in-process
// run asks the sites the server would ask and folds their scores as it does,
// so a loopback run (the real server, the sites over TLS) reports the same
// figures up to its fold order; rounds not due report none, and the report's
// JSON keeps them.
#include <gtest/gtest.h>

#include <cmath>

#include "simulations/report.h"
#include "simulations/runner.h"
#include "tests/e2e/harness.h"
#include "tests/simulations/small_mnist.h"

namespace estuary::simulations {
namespace {

TEST(SimulationEvaluation, InprocAndLoopbackReportTheSameFederatedCurve) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 600, 200, 3);
  Scenario s = Small(dir / "data", dir / "run");  // 12 sites of 50 examples (shards)
  s.server_binary = testing::BinaryPath("estuary-server");
  s.evaluate_every = 2;
  s.evaluate_clients = 0.5;
  s.eval_split = 0.1;
  auto inproc = RunInproc(s, nullptr);
  ASSERT_TRUE(inproc.ok()) << inproc.status().ToString();
  ASSERT_EQ(inproc->rounds.size(), 3u);
  EXPECT_FALSE(inproc->rounds[0].federated_accuracy.has_value()) << "round 1 is not due";
  EXPECT_FALSE(inproc->rounds[0].federated_examples.has_value());
  for (size_t r : {1u, 2u}) {
    const RoundReport& row = inproc->rounds[r];
    // 6 of the 12 sites, each holding out 5 of its 50 examples.
    ASSERT_TRUE(row.federated_examples && row.federated_accuracy && row.federated_loss) << "round " << r + 1;
    EXPECT_EQ(*row.federated_examples, 30u);
    const double correct = *row.federated_accuracy * 30;
    EXPECT_NEAR(correct, std::round(correct), 1e-9) << "a count of the 30 examples";
    EXPECT_GT(*row.federated_loss, 0);
  }
  // The sites hold out what they score: they train on 45 examples each.
  s.mode = "loopback";
  auto loopback = RunLoopback(s, nullptr);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  ASSERT_EQ(loopback->rounds.size(), 3u);
  EXPECT_FALSE(loopback->rounds[0].federated_accuracy.has_value());
  for (size_t r : {1u, 2u}) {
    const RoundReport &a = inproc->rounds[r], &b = loopback->rounds[r];
    ASSERT_TRUE(b.federated_examples && b.federated_accuracy && b.federated_loss) << "round " << r + 1;
    EXPECT_EQ(*b.federated_examples, *a.federated_examples);
    // Same sites, same held-out examples, the same model to rounding.
    EXPECT_NEAR(*b.federated_accuracy, *a.federated_accuracy, 1.5 / 30) << "round " << r + 1;
    EXPECT_NEAR(*b.federated_loss, *a.federated_loss, 1e-3) << "round " << r + 1;
  }
  auto back = ReportFromJson(ToJson(*inproc));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->rounds[2].federated_examples, inproc->rounds[2].federated_examples);
  EXPECT_EQ(back->rounds[2].federated_accuracy, inproc->rounds[2].federated_accuracy);
  EXPECT_FALSE(back->rounds[0].federated_loss.has_value());
}

TEST(SimulationEvaluation, BadEvaluationFlagsNameTheProblem) {
  testing::TempDir dir;
  testing::WriteSyntheticMnist(dir / "data", 60, 20, 3);
  Scenario s = Small(dir / "data", dir / "run");
  s.evaluate_every = 1;
  s.eval_split = 0;
  auto run = RunInproc(s, nullptr);
  ASSERT_FALSE(run.ok());
  EXPECT_NE(run.status().message().find("--eval-split 0"), std::string::npos) << run.status().message();
  s.eval_split = 0.1;
  s.evaluate_clients = -1;
  run = RunInproc(s, nullptr);
  ASSERT_FALSE(run.ok());
  EXPECT_NE(run.status().message().find("--evaluate-clients -1"), std::string::npos) << run.status().message();
}

}  // namespace
}  // namespace estuary::simulations
