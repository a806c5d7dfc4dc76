// The cap on a round's local training time: rank 0's clock decides for every
// rank, the step that crosses the cap is the last, and a site's own cap and
// the server's combine to the tighter.
#include "client/local_deadline.h"

#include <gtest/gtest.h>

#include <cblas.h>

#include <random>

#include "client/local_work.h"
#include "client/site.h"
#include "comm/gloo_communicator.h"
#include "models/model.h"
#include "tests/comm/ranks.h"

namespace estuary::client {
namespace {

using namespace std::chrono_literals;
using comm::testing::FreeTcpAddress;
using comm::testing::RunRanks;
using Clock = LocalDeadline::Clock;

// A clock that moves `step` further each time it is read.
std::function<Clock::time_point()> Ticking(std::chrono::milliseconds step, int* reads = nullptr) {
  auto now = std::make_shared<Clock::time_point>();
  return [now, step, reads] {
    if (reads) ++*reads;
    return *now += step;
  };
}

TEST(LocalDeadline, WithNoCapItNeverReadsTheClockAgain) {
  auto solo = comm::MakeSoloCommunicator(Device::kCpu);
  int reads = 0;
  LocalDeadline deadline(0, *solo, Ticking(1h, &reads));
  for (int i = 0; i < 100; ++i) EXPECT_FALSE(*deadline.Reached());
  EXPECT_EQ(reads, 1);  // the start
}

TEST(LocalDeadline, IsReachedAtTheFirstReadPastTheCap) {
  auto solo = comm::MakeSoloCommunicator(Device::kCpu);
  LocalDeadline deadline(1.0, *solo, Ticking(400ms));  // reads at 0.4, 0.8, 1.2 s after the start
  EXPECT_FALSE(*deadline.Reached());
  EXPECT_FALSE(*deadline.Reached());
  EXPECT_TRUE(*deadline.Reached());
}

// Rank 1's clock says the cap passed long ago; rank 0's passes it at its
// fourth read: rank 1 answers what rank 0 decides, read by read.
TEST(LocalDeadline, EveryRankFollowsRankZerosClock) {
  const std::string address = FreeTcpAddress();
  auto outcomes = RunRanks(2, [&](int rank) -> Status {
    ESTUARY_ASSIGN_OR_RETURN(auto comm, comm::ConnectGloo({.address = address, .rank = rank, .size = 2, .timeout = 60s},
                                                          {.host = "127.0.0.1"}));
    LocalDeadline deadline(1.0, *comm, rank == 0 ? Ticking(300ms) : Ticking(1h));
    for (int read = 1; read <= 4; ++read) {
      ESTUARY_ASSIGN_OR_RETURN(const bool reached, deadline.Reached());
      if (reached != (read == 4)) return Internal("rank {}: read {} said {}", rank, read, reached);
    }
    return Status::Ok();
  });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << o.Describe();
}

std::shared_ptr<const models::Dataset> Images(int n) {
  auto data = std::make_shared<models::Dataset>();
  data->feature_size = 784;
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> pixel(0, 1);
  data->features.resize(size_t(n) * 784);
  for (auto& v : data->features) v = pixel(gen);
  for (int i = 0; i < n; ++i) data->labels.push_back(int32_t(gen() % 10));
  return data;
}

v1::TaskConfig Task(double max_local_seconds) {
  v1::TaskConfig task;
  task.set_model("mlp");
  task.set_epochs(5);
  task.set_batch_size(10);
  task.set_learning_rate(0.05f);
  task.set_momentum(0.5f);
  task.set_seed(11);
  task.set_seq_len(128);  // unused by the MLP, but a task must name one
  task.set_max_local_seconds(max_local_seconds);
  return task;
}

struct Global {
  std::vector<float> weights;
  Manifest manifest;
};
Global Initial() {
  auto model = models::MakeModel("mlp").value();
  model->Initialize(3);
  return {{model->parameters().begin(), model->parameters().end()}, model->manifest()};
}

// A cap far below one step's time: the site stops after its first step,
// with the update the first step alone makes (bit for bit), and says so.
TEST(LocalTimeCap, ASiteStopsAfterTheStepThatCrossesItAndReportsItsSteps) {
  openblas_set_num_threads(1);
  const Global g = Initial();
  auto images = Images(61);  // 7 batches of 10 a epoch: 35 steps uncapped
  auto site = MakeLocalSite({.images = images}, {}).value();

  auto full = site->Train(g.weights, g.manifest, Task(0), 1, "site-a");
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  EXPECT_EQ(full->local_steps, 35u);

  auto capped = site->Train(g.weights, g.manifest, Task(1e-9), 1, "site-a");
  ASSERT_TRUE(capped.ok()) << capped.status().ToString();
  EXPECT_EQ(capped->local_steps, 1u);
  EXPECT_DOUBLE_EQ(capped->normalizer, FedNovaNormalizer(*TaskFromProto(Task(1e-9)), 1));
  v1::TaskConfig one_step = Task(0);
  one_step.set_max_local_steps(1);
  auto first = site->Train(g.weights, g.manifest, one_step, 1, "site-a");
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(capped->payload, first->payload);
  EXPECT_NE(capped->payload, full->payload);

  // A generous cap changes nothing: every step runs.
  auto generous = site->Train(g.weights, g.manifest, Task(3600), 1, "site-a");
  ASSERT_TRUE(generous.ok());
  EXPECT_EQ(generous->local_steps, 35u);
  EXPECT_EQ(generous->payload, full->payload);
}

TEST(LocalTimeCap, TheTighterOfTheSitesCapAndTheServersApplies) {
  openblas_set_num_threads(1);
  const Global g = Initial();
  auto site = MakeLocalSite({.images = Images(61)}, {}).value();
  site->set_max_local_seconds(1e-9);  // the site's own, with none from the server
  auto own = site->Train(g.weights, g.manifest, Task(0), 1, "site-a");
  ASSERT_TRUE(own.ok()) << own.status().ToString();
  EXPECT_EQ(own->local_steps, 1u);
  auto both = site->Train(g.weights, g.manifest, Task(3600), 1, "site-a");  // the server's is looser
  ASSERT_TRUE(both.ok());
  EXPECT_EQ(both->local_steps, 1u);

  site->set_max_local_seconds(3600);  // now the server's is the tighter
  auto server = site->Train(g.weights, g.manifest, Task(1e-9), 1, "site-a");
  ASSERT_TRUE(server.ok());
  EXPECT_EQ(server->local_steps, 1u);
  auto none = site->Train(g.weights, g.manifest, Task(0), 1, "site-a");
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->local_steps, 35u);
}

// Two ranks under a cap stop after the same step: rank 0's update is the one
// process's first step, and the follower is still in step for the next round.
TEST(LocalTimeCap, TheRanksOfASiteStopTogether) {
  const std::string address = FreeTcpAddress();
  auto outcomes = RunRanks(2, [&](int rank) -> Status {
    openblas_set_num_threads(1);
    ESTUARY_ASSIGN_OR_RETURN(auto comm, comm::ConnectGloo({.address = address, .rank = rank, .size = 2, .timeout = 60s},
                                                          {.host = "127.0.0.1"}));
    auto images = Images(61);
    auto rank_trainer = MakeClassifierRankTrainer(*comm, images, {}, {});
    if (rank != 0) return RunFollower(*comm, *rank_trainer);
    const Global g = Initial();
    SiteTrainer site(*comm, std::move(rank_trainer), parallel::ZeroStage::kDdp, Compute{});
    ESTUARY_ASSIGN_OR_RETURN(auto single, MakeLocalSite({.images = images}, {}));
    v1::TaskConfig one_step = Task(0);
    one_step.set_max_local_steps(1);
    ESTUARY_ASSIGN_OR_RETURN(Update want, single->Train(g.weights, g.manifest, one_step, 1, "site-a"));
    for (uint64_t round = 1; round <= 2; ++round) {
      ESTUARY_ASSIGN_OR_RETURN(Update got, site.Train(g.weights, g.manifest, Task(1e-9), 1, "site-a"));
      if (got.local_steps != 1) return Internal("round {}: {} steps under the cap", round, got.local_steps);
      double diff = 0, norm = 0;
      for (size_t i = 0; i < got.payload.size(); ++i) {
        diff += std::pow(double(got.payload[i]) - want.payload[i], 2);
        norm += std::pow(double(want.payload[i]), 2);
      }
      if (!(std::sqrt(diff / norm) <= 1e-5)) return Internal("round {}: off one process's first step", round);
    }
    return site.Finish(Status::Ok());
  });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << o.Describe();
}

}  // namespace
}  // namespace estuary::client
