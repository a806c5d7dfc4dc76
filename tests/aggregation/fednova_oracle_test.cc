// FedNova against numpy_fednova.py, the paper's update rule applied to the
// recorded local gradients of sites that trained with plain SGD, momentum
// and FedProx's proximal term; and the sites' normaliser ‖a‖₁
// (client/local_work.h) against the paper's closed forms.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "aggregation/fedavg.h"
#include "aggregation/fednova.h"
#include "client/local_work.h"
#include "tests/aggregation/oracle_file.h"

namespace estuary::aggregation {
namespace {

struct Site {
  double examples = 0;
  uint64_t steps = 0;
  double momentum = 0, mu = 0, normalizer = 0;
  std::vector<float> delta;
};

struct Oracle {
  double lr = 0;
  std::vector<float> global;
  std::vector<Site> sites;
  std::vector<double> fednova, fedavg;
  double tau_eff = 0;
};

Oracle Load() {
  Oracle o;
  std::string error;
  const bool read = testing::ReadOracleFile(
      ESTUARY_FEDNOVA_ORACLE, "estuary-fednova-oracle 1", "aggregation_numpy_fednova",
      [&](const std::string& tag, std::istringstream& line) {
        if (tag == "lr") return bool(line >> o.lr);
        if (tag == "global") return (o.global = testing::ReadValues<float>(line, 23)), true;
        if (tag == "site") {
          Site s;
          line >> s.examples >> s.steps >> s.momentum >> s.mu >> s.normalizer;
          s.delta = testing::ReadValues<float>(line, 23);
          o.sites.push_back(std::move(s));
          return true;
        }
        if (tag == "fednova") return (o.fednova = testing::ReadValues<double>(line, 23)), true;
        if (tag == "fedavg") return (o.fedavg = testing::ReadValues<double>(line, 23)), true;
        if (tag == "tau_eff") return bool(line >> o.tau_eff);
        return false;
      },
      error);
  EXPECT_TRUE(read) << error;
  return o;
}

client::TaskConfig TaskOf(const Oracle& o, const Site& s) {
  client::TaskConfig task;
  task.learning_rate = float(o.lr);
  task.momentum = float(s.momentum);
  task.proximal_mu = float(s.mu);
  return task;
}

TEST(FedNovaOracle, SiteNormalizerIsThePapersClosedForm) {
  const Oracle o = Load();
  ASSERT_EQ(o.sites.size(), 6u);
  for (const Site& s : o.sites) {
    // The task's lr, momentum and μ are floats: the recurrence sees them rounded.
    EXPECT_NEAR(client::FedNovaNormalizer(TaskOf(o, s), s.steps), s.normalizer, 1e-6 * s.normalizer)
        << "τ " << s.steps << " momentum " << s.momentum << " μ " << s.mu;
  }
}

TEST(FedNovaOracle, RoundIsThePapersUpdate) {
  const Oracle o = Load();
  ASSERT_EQ(o.sites.size(), 6u);
  FedNova nova;
  ASSERT_TRUE(nova.Begin(1, o.global).ok());
  for (const Site& s : o.sites) {
    const LocalWork work{.steps = s.steps, .normalizer = client::FedNovaNormalizer(TaskOf(o, s), s.steps)};
    ASSERT_TRUE(nova.FoldWork("site", Manifest{}, nullptr, s.delta, s.examples, work).ok());
  }
  std::vector<float> out(o.global.size());
  ASSERT_TRUE(nova.Finish(out).ok());
  EXPECT_NEAR(nova.effective_steps(), o.tau_eff, 1e-6 * o.tau_eff);
  double furthest_from_fedavg = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_NEAR(out[i], o.fednova[i], 1e-6) << "parameter " << i;
    furthest_from_fedavg = std::max(furthest_from_fedavg, std::abs(o.fednova[i] - o.fedavg[i]));
  }
  // Unequal local work: the oracle is not FedAvg, so matching it means something.
  EXPECT_GT(furthest_from_fedavg, 1e-2);
}

TEST(FedNovaOracle, EqualLocalWorkIsFedAvg) {
  const Oracle o = Load();
  FedNova nova;
  FedAvg avg;
  ASSERT_TRUE(nova.Begin(3, o.global).ok());
  ASSERT_TRUE(avg.Begin(3, o.global).ok());
  for (const Site& s : o.sites) {
    ASSERT_TRUE(nova.FoldWork("site", Manifest{}, nullptr, s.delta, s.examples, {.steps = 8, .normalizer = 8}).ok());
    ASSERT_TRUE(avg.Fold(s.delta, s.examples).ok());
  }
  std::vector<float> nova_out(o.global.size()), avg_out(o.global.size());
  ASSERT_TRUE(nova.Finish(nova_out).ok());
  ASSERT_TRUE(avg.Finish(avg_out).ok());
  EXPECT_DOUBLE_EQ(nova.effective_steps(), 8.0);
  for (size_t i = 0; i < nova_out.size(); ++i) {
    EXPECT_NEAR(nova_out[i], avg_out[i], 1e-6) << "parameter " << i;
    EXPECT_NEAR(avg_out[i], o.fedavg[i], 1e-6) << "parameter " << i;
  }
}

}  // namespace
}  // namespace estuary::aggregation

namespace estuary::aggregation {
namespace {

TEST(FedNova, RefusesUpdatesWithoutLocalWorkAndChangesNothing) {
  const std::vector<float> global = {1, 2, 3};
  const std::vector<float> delta = {0.5f, -1, 2};
  FedNova nova;
  ASSERT_TRUE(nova.Begin(1, global).ok());
  const Status plain = nova.Fold(delta, 1);
  EXPECT_FALSE(plain.ok());
  EXPECT_NE(plain.message().find("no local steps"), std::string::npos) << plain.message();
  const Status unset = nova.FoldWork("site-7", Manifest{}, nullptr, delta, 1, {.steps = 3, .normalizer = 0});
  EXPECT_NE(unset.message().find("site-7"), std::string::npos) << unset.message();
  EXPECT_FALSE(nova.FoldWork("site-7", Manifest{}, nullptr, delta, 1, {.steps = 3, .normalizer = -2}).ok());
  EXPECT_FALSE(nova.FoldWork("site-7", Manifest{}, nullptr, delta, 1, {.steps = 3, .normalizer = NAN}).ok());
  EXPECT_FALSE(nova.FoldWork("site-7", Manifest{}, nullptr, delta, 0, {.steps = 3, .normalizer = 3}).ok());
  EXPECT_EQ(nova.folded(), 0u);
  // One good update after the refused ones: the round is that update's alone.
  ASSERT_TRUE(nova.FoldWork("site-8", Manifest{}, nullptr, delta, 4, {.steps = 2, .normalizer = 2}).ok());
  std::vector<float> out(3);
  ASSERT_TRUE(nova.Finish(out).ok());
  EXPECT_EQ(out, (std::vector<float>{1.5f, 1, 5}));
}

}  // namespace
}  // namespace estuary::aggregation
