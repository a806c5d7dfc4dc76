// FedBuff against numpy_fedbuff.py, the paper's Algorithm 1 run on a
// simulated clock (sites of different speeds, so updates arrive stale), under
// each staleness weight, with K from 1 to 3, a server lr other than 1 and a
// max staleness that refuses some; and the parts of the contract the oracle
// does not reach (bad options, refusals that change nothing).
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "aggregation/fedbuff.h"
#include "tests/aggregation/oracle_file.h"

namespace estuary::aggregation {
namespace {

constexpr size_t kD = 19;

struct Arrival {
  uint64_t from = 0;
  int64_t staleness = 0;  // -1: refused
  double weight = 0;
  std::vector<float> delta;
  std::optional<std::vector<double>> version;  // the model after it, when it completed a version
};

struct Scenario {
  std::string weight;
  uint32_t buffer = 0;
  double lr = 0;
  uint64_t max_staleness = 0;
  std::vector<float> start;
  std::vector<Arrival> arrivals;
};

std::vector<Scenario> Load() {
  std::vector<Scenario> scenarios;
  std::string error;
  const bool read = testing::ReadOracleFile(
      ESTUARY_FEDBUFF_ORACLE, "estuary-fedbuff-oracle 1", "aggregation_numpy_fedbuff",
      [&](const std::string& tag, std::istringstream& line) {
        if (tag == "scenario") {
          Scenario s;
          line >> s.weight >> s.buffer >> s.lr >> s.max_staleness;
          scenarios.push_back(std::move(s));
          return true;
        }
        if (scenarios.empty()) return false;
        Scenario& s = scenarios.back();
        if (tag == "start") return (s.start = testing::ReadValues<float>(line, kD)), true;
        if (tag == "arrival") {
          Arrival a;
          line >> a.from >> a.staleness >> a.weight;
          a.delta = testing::ReadValues<float>(line, kD);
          s.arrivals.push_back(std::move(a));
          return true;
        }
        if (tag == "version") {
          uint64_t t = 0;
          line >> t;
          if (s.arrivals.empty()) return false;
          s.arrivals.back().version = testing::ReadValues<double>(line, kD);
          return true;
        }
        return false;
      },
      error);
  EXPECT_TRUE(read) << error;
  return scenarios;
}

TEST(FedBuff, FollowsThePapersAlgorithm) {
  const std::vector<Scenario> scenarios = Load();
  ASSERT_EQ(scenarios.size(), 4u);
  int refused = 0, stale = 0;
  for (const Scenario& s : scenarios) {
    SCOPED_TRACE(s.weight);
    auto weight = ParseStalenessWeight(s.weight);
    ASSERT_TRUE(weight.ok()) << weight.status().message();
    auto made = FedBuff::Create({.buffer = s.buffer, .server_lr = s.lr, .weight = *weight,
                                 .max_staleness = s.max_staleness},
                                kD);
    ASSERT_TRUE(made.ok()) << made.status().message();
    FedBuff fedbuff = std::move(*made);
    std::vector<float> global = s.start;
    int versions = 0;
    for (size_t i = 0; i < s.arrivals.size(); ++i) {
      const Arrival& a = s.arrivals[i];
      SCOPED_TRACE(i);
      auto folded = fedbuff.Fold(a.delta, a.from);
      if (a.staleness < 0) {
        ASSERT_FALSE(folded.ok());
        EXPECT_NE(folded.status().message().find("stale"), std::string::npos) << folded.status().message();
        ++refused;
        continue;
      }
      ASSERT_TRUE(folded.ok()) << folded.status().message();
      EXPECT_EQ(folded->staleness, uint64_t(a.staleness));
      EXPECT_NEAR(folded->weight, a.weight, 1e-15);
      if (a.staleness > 0) ++stale;
      ASSERT_EQ(folded->full, a.version.has_value());
      if (!folded->full) continue;
      ASSERT_TRUE(fedbuff.Step(global).ok());
      ++versions;
      EXPECT_EQ(fedbuff.version(), uint64_t(versions));
      for (size_t j = 0; j < kD; ++j) EXPECT_NEAR(global[j], (*a.version)[j], 1e-6 * (1 + std::abs((*a.version)[j])));
    }
    EXPECT_GE(versions, 10);
  }
  // The oracle exercises what it is meant to: stale updates, and refused ones.
  EXPECT_GT(stale, 50);
  EXPECT_GT(refused, 0);
}

TEST(FedBuff, StalenessWeights) {
  auto poly = ParseStalenessWeight("poly:0.5");
  ASSERT_TRUE(poly.ok());
  EXPECT_DOUBLE_EQ((*poly)(0), 1.0);
  EXPECT_DOUBLE_EQ((*poly)(3), 0.5);
  auto hinge = ParseStalenessWeight("hinge:10,4");
  ASSERT_TRUE(hinge.ok());
  EXPECT_DOUBLE_EQ((*hinge)(4), 1.0);
  EXPECT_DOUBLE_EQ((*hinge)(6), 1.0 / 21.0);
  EXPECT_EQ(hinge->ToString(), "hinge:10,4");
  EXPECT_DOUBLE_EQ((*ParseStalenessWeight("constant"))(1000), 1.0);
  for (const char* bad : {"", "poly", "poly:", "poly:-1", "poly:nan", "hinge:1", "hinge:1,", "hinge:1,2,3", "linear:1",
                          "poly:1x"}) {
    auto parsed = ParseStalenessWeight(bad);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_NE(parsed.status().message().find(fmt::format("'{}'", bad)), std::string::npos);
  }
}

TEST(FedBuff, RefusalsChangeNothing) {
  EXPECT_FALSE(FedBuff::Create({.buffer = 0}, 4).ok());
  EXPECT_FALSE(FedBuff::Create({.buffer = 2, .server_lr = 0}, 4).ok());
  EXPECT_FALSE(FedBuff::Create({.buffer = 2}, 0).ok());
  auto made = FedBuff::Create({.buffer = 2, .server_lr = 0.5, .max_staleness = 1}, 3, 5);
  ASSERT_TRUE(made.ok());
  FedBuff fedbuff = std::move(*made);
  std::vector<float> global = {1, 2, 3};
  const std::vector<float> one = {2, 2, 2}, nan = {1, NAN, 1}, short_delta = {1, 1};
  EXPECT_EQ(fedbuff.Fold(one, 6).status().code(), Code::kInvalidArgument);  // from the future
  EXPECT_EQ(fedbuff.Fold(one, 3).status().code(), Code::kFailedPrecondition);  // τ = 2 > 1
  EXPECT_EQ(fedbuff.Fold(nan, 5).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(fedbuff.Fold(short_delta, 5).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(fedbuff.buffered(), 0u);
  EXPECT_FALSE(fedbuff.Step(global).ok());  // nothing buffered
  ASSERT_TRUE(fedbuff.Fold(one, 4).ok());
  auto second = fedbuff.Fold(one, 5);
  ASSERT_TRUE(second.ok());
  EXPECT_TRUE(second->full);
  EXPECT_FALSE(fedbuff.Fold(one, 5).ok());  // full: step first
  ASSERT_TRUE(fedbuff.Step(global).ok());
  // x + 0.5 · (2 + 2) / 2
  EXPECT_EQ(global, (std::vector<float>{2, 3, 4}));
  EXPECT_EQ(fedbuff.version(), 6u);
  EXPECT_EQ(fedbuff.buffered(), 0u);
  // A step that would overflow writes nothing and keeps the buffer.
  const std::vector<float> huge = {3e38f, 0, 0};
  ASSERT_TRUE(fedbuff.Fold(huge, 6).ok());
  ASSERT_TRUE(fedbuff.Fold(huge, 6).ok());
  std::vector<float> big = {3e38f, 0, 0};
  EXPECT_FALSE(fedbuff.Step(big).ok());
  EXPECT_EQ(big, (std::vector<float>{3e38f, 0, 0}));
  EXPECT_EQ(fedbuff.buffered(), 2u);
}

TEST(FedBuff, RefusesFederationsThatNeedAWholeRound) {
  v1::FederationConfig f;
  f.mutable_strategy()->set_name("fedavg");
  EXPECT_TRUE(CheckFedBuffFederation(f).ok());
  for (const char* name : {"scaffold", "fednova", "median", "krum", "bulyan", "trimmed-mean", "fedadam"}) {
    f.mutable_strategy()->set_name(name);
    const Status refused = CheckFedBuffFederation(f);
    ASSERT_FALSE(refused.ok()) << name;
    EXPECT_NE(refused.message().find(name), std::string::npos) << refused.message();
  }
  f.mutable_strategy()->set_name("fedavg");
  f.mutable_dp()->set_noise_multiplier(1);
  EXPECT_NE(CheckFedBuffFederation(f).message().find("DP"), std::string::npos);
  f.clear_dp();
  f.mutable_task()->set_update_kind(v1::UPDATE_LORA);
  EXPECT_NE(CheckFedBuffFederation(f).message().find("lora"), std::string::npos);
}

}  // namespace
}  // namespace estuary::aggregation
