#include "aggregation/fedavg.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "aggregation/strategy.h"

namespace estuary::aggregation {
namespace {

struct Update {
  std::vector<float> delta;
  double weight;
};

std::vector<float> RandomVector(std::mt19937_64& rng, size_t n, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

std::vector<Update> RandomUpdates(std::mt19937_64& rng, size_t n, size_t clients) {
  std::uniform_int_distribution<int> examples(1, 1000);
  std::vector<Update> updates;
  for (size_t c = 0; c < clients; ++c) updates.push_back({RandomVector(rng, n, 0.1f), double(examples(rng))});
  return updates;
}

std::vector<float> RunFedAvg(std::span<const float> global, const std::vector<Update>& updates) {
  FedAvg fedavg;
  EXPECT_TRUE(fedavg.Begin(1, global).ok());
  for (const Update& u : updates) EXPECT_TRUE(fedavg.Fold(u.delta, u.weight).ok());
  std::vector<float> out(global.size());
  EXPECT_TRUE(fedavg.Finish(out).ok());
  return out;
}

bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(FedAvg, EqualsDirectWeightedMean) {
  std::mt19937_64 rng(1234);
  const size_t n = 10000;
  const std::vector<float> global = RandomVector(rng, n, 1.0f);
  const std::vector<Update> updates = RandomUpdates(rng, n, 7);
  const std::vector<float> out = RunFedAvg(global, updates);

  double total_weight = 0;
  for (const Update& u : updates) total_weight += u.weight;
  double worst = 0;
  for (size_t i = 0; i < n; ++i) {
    double weighted = 0;
    for (const Update& u : updates) weighted += u.weight * double(u.delta[i]);
    const double expected = double(global[i]) + weighted / total_weight;
    worst = std::max(worst, std::abs(out[i] - expected) / std::max(std::abs(expected), double(FLT_MIN)));
  }
  EXPECT_LE(worst, 1e-6);
}

TEST(FedAvg, FoldOrderOnlyChangesRounding) {
  std::mt19937_64 rng(99);
  const size_t n = 5000;
  const std::vector<float> global = RandomVector(rng, n, 1.0f);
  std::vector<Update> updates = RandomUpdates(rng, n, 9);
  const std::vector<float> forward = RunFedAvg(global, updates);
  std::shuffle(updates.begin(), updates.end(), rng);
  const std::vector<float> shuffled = RunFedAvg(global, updates);
  for (size_t i = 0; i < n; ++i) {
    // Double accumulation: reordering may move the float result by one ulp at most.
    EXPECT_LE(std::abs(forward[i] - shuffled[i]), std::abs(forward[i]) * FLT_EPSILON) << i;
  }
}

TEST(FedAvg, RejectedFoldsLeaveNoTrace) {
  std::mt19937_64 rng(7);
  const size_t n = 257;
  const std::vector<float> global = RandomVector(rng, n, 1.0f);
  const std::vector<Update> good = RandomUpdates(rng, n, 2);
  const std::vector<float> clean = RunFedAvg(global, good);

  FedAvg fedavg;
  ASSERT_TRUE(fedavg.Begin(3, global).ok());
  ASSERT_TRUE(fedavg.Fold(good[0].delta, good[0].weight).ok());

  std::vector<float> with_nan = good[1].delta;
  with_nan[200] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> with_inf = good[1].delta;
  with_inf[n - 1] = -std::numeric_limits<float>::infinity();
  const std::vector<float> too_short(n - 1, 0.5f);
  const std::vector<float> too_long(n + 1, 0.5f);

  struct Bad {
    std::vector<float> delta;
    double weight;
    std::string mention;
  };
  const std::vector<Bad> bad = {
      {too_short, 1, "256 values"},
      {too_long, 1, "258 values"},
      {good[1].delta, 0, "weight"},
      {good[1].delta, -3, "weight"},
      {good[1].delta, std::numeric_limits<double>::quiet_NaN(), "weight"},
      {good[1].delta, std::numeric_limits<double>::infinity(), "weight"},
      {with_nan, 10, "delta[200]"},
      {with_inf, 10, "delta[256]"},
  };
  for (const Bad& b : bad) {
    Status status = fedavg.Fold(b.delta, b.weight);
    EXPECT_EQ(status.code(), Code::kInvalidArgument) << b.mention;
    EXPECT_NE(status.message().find(b.mention), std::string::npos) << status.message();
  }
  EXPECT_EQ(fedavg.folded(), 1u);
  ASSERT_TRUE(fedavg.Fold(good[1].delta, good[1].weight).ok());
  EXPECT_EQ(fedavg.folded(), 2u);
  std::vector<float> out(n);
  ASSERT_TRUE(fedavg.Finish(out).ok());
  EXPECT_TRUE(BitwiseEqual(out, clean));
}

TEST(FedAvg, FinishNeedsAFold) {
  const std::vector<float> global = {1, 2, 3};
  std::vector<float> out(3);
  FedAvg fedavg;
  EXPECT_EQ(fedavg.Finish(out).code(), Code::kFailedPrecondition);  // no round
  EXPECT_EQ(fedavg.Fold(global, 1).code(), Code::kFailedPrecondition);
  ASSERT_TRUE(fedavg.Begin(1, global).ok());
  Status empty = fedavg.Finish(out);
  EXPECT_EQ(empty.code(), Code::kFailedPrecondition);
  EXPECT_NE(empty.message().find("no folded update"), std::string::npos) << empty.message();
  ASSERT_TRUE(fedavg.Fold(std::vector<float>{1, 1, 1}, 2).ok());
  ASSERT_TRUE(fedavg.Finish(out).ok());
  EXPECT_EQ(out, (std::vector<float>{2, 3, 4}));
  EXPECT_EQ(fedavg.Finish(out).code(), Code::kFailedPrecondition);  // round already closed
}

TEST(FedAvg, FinishInPlaceAndSizeChecks) {
  std::vector<float> global = {1, 2, 3, 4};
  FedAvg fedavg;
  ASSERT_TRUE(fedavg.Begin(1, global).ok());
  ASSERT_TRUE(fedavg.Fold(std::vector<float>{1, 0, 0, 0}, 1).ok());
  ASSERT_TRUE(fedavg.Fold(std::vector<float>{0, 0, 0, 4}, 3).ok());
  std::vector<float> wrong(3);
  EXPECT_EQ(fedavg.Finish(wrong).code(), Code::kInvalidArgument);
  ASSERT_TRUE(fedavg.Finish(global).ok());  // the span given to Begin
  EXPECT_EQ(global, (std::vector<float>{1.25f, 2, 3, 7}));
}

TEST(FedAvg, BeginRestartsTheRound) {
  const std::vector<float> global = {0, 0};
  FedAvg fedavg;
  ASSERT_TRUE(fedavg.Begin(1, global).ok());
  ASSERT_TRUE(fedavg.Fold(std::vector<float>{100, 100}, 5).ok());
  ASSERT_TRUE(fedavg.Begin(1, global).ok());
  EXPECT_EQ(fedavg.folded(), 0u);
  ASSERT_TRUE(fedavg.Fold(std::vector<float>{1, -1}, 5).ok());
  std::vector<float> out(2);
  ASSERT_TRUE(fedavg.Finish(out).ok());
  EXPECT_EQ(out, (std::vector<float>{1, -1}));
}

TEST(FedAvg, BeginRejectsBadGlobal) {
  FedAvg fedavg;
  EXPECT_EQ(fedavg.Begin(1, std::vector<float>{}).code(), Code::kInvalidArgument);
  EXPECT_EQ(fedavg.Begin(1, std::vector<float>{1, std::nanf("")}).code(), Code::kInvalidArgument);
}

// A delta that would take a parameter beyond float's range is refused at
// its fold, touching nothing: that update fails, and the round still
// finishes with the others (the mean of deltas that each stay in range
// stays in range too).
TEST(FedAvg, ADeltaThatWouldOverflowIsRefusedAtItsFold) {
  const std::vector<float> global = {FLT_MAX, 1};
  FedAvg fedavg;
  ASSERT_TRUE(fedavg.Begin(1, global).ok());
  const Status refused = fedavg.Fold(std::vector<float>{FLT_MAX, 1}, 1);
  EXPECT_EQ(refused.code(), Code::kInvalidArgument);
  EXPECT_NE(refused.message().find("delta[0]"), std::string::npos) << refused.message();
  EXPECT_EQ(fedavg.folded(), 0u);
  ASSERT_TRUE(fedavg.Fold(std::vector<float>{-1, 2}, 1).ok());
  std::vector<float> out = {-1, -1};
  ASSERT_TRUE(fedavg.Finish(out).ok());
  EXPECT_EQ(out, (std::vector<float>{FLT_MAX, 3}));  // FLT_MAX - 1 rounds to FLT_MAX
}

TEST(MakeStrategy, ByName) {
  auto fedavg = MakeStrategy({.name = "fedavg"});
  ASSERT_TRUE(fedavg.ok());
  EXPECT_EQ((*fedavg)->name(), "fedavg");
  auto fedadam = MakeStrategy({.name = "fedadam"});
  ASSERT_TRUE(fedadam.ok());
  EXPECT_EQ((*fedadam)->name(), "fedadam");
  auto unknown = MakeStrategy({.name = "fedprox"});
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), Code::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("'fedprox'"), std::string::npos) << unknown.status().message();
}

TEST(MakeStrategy, ValidatesOptions) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<StrategyOptions> bad;
  for (double lr : {0.0, -0.1, nan, HUGE_VAL}) bad.push_back({.name = "fedadam", .server_lr = lr});
  for (double beta : {-0.1, 1.0, 1.5, nan}) {
    bad.push_back({.name = "fedadam", .beta1 = beta});
    bad.push_back({.name = "fedadam", .beta2 = beta});
  }
  for (double tau : {0.0, -1e-3, nan, HUGE_VAL}) bad.push_back({.name = "fedadam", .tau = tau});
  for (double momentum : {-0.1, 1.0, nan}) bad.push_back({.name = "fedavgm", .server_momentum = momentum});
  for (const char* name : {"fedyogi", "fedadagrad", "fedavgm"}) bad.push_back({.name = name, .bias_correction = true});
  for (const StrategyOptions& options : bad) {
    auto strategy = MakeStrategy(options);
    EXPECT_FALSE(strategy.ok()) << options.server_lr << " " << options.beta1 << " " << options.beta2 << " "
                                << options.tau;
    if (!strategy.ok()) {
      EXPECT_EQ(strategy.status().code(), Code::kInvalidArgument);
    }
  }
  EXPECT_TRUE(MakeStrategy({.name = "fedadam", .beta1 = 0, .beta2 = 0, .bias_correction = true}).ok());
}

}  // namespace
}  // namespace estuary::aggregation

namespace estuary::aggregation {
namespace {

// The fold over several threads: the same sums to the bit, and a non-finite
// value in any thread's range still refuses the whole delta, touching nothing.
TEST(WeightedMean, ThreadsGiveOneThreadsSumsAndStillRefuseNonFiniteValues) {
  const size_t n = (size_t(1) << 20) + 12345;  // several threads' worth, not a multiple of any count
  std::vector<float> a(n), b(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = float(std::sin(double(i))) * 1e-2f;
    b[i] = float(std::cos(double(i) * 0.7)) * 3e-3f;
  }
  WeightedMean one, four;
  four.set_threads(4);
  for (WeightedMean* m : {&one, &four}) {
    m->Reset(n);
    ASSERT_TRUE(m->Add(a, 3).ok());
    ASSERT_TRUE(m->Add(b, 7.5).ok());
  }
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(one.Mean(i), four.Mean(i)) << i;
  }
  std::vector<float> bad = a;
  bad[n - 3] = std::numeric_limits<float>::infinity();  // in the last thread's range
  const Status refused = four.Add(bad, 1);
  EXPECT_EQ(refused.code(), Code::kInvalidArgument);
  EXPECT_NE(refused.message().find(fmt::format("delta[{}] is inf", n - 3)), std::string::npos) << refused.message();
  EXPECT_EQ(four.count(), 2u);
  EXPECT_EQ(one.Mean(7), four.Mean(7)) << "untouched by the refused delta";
}

}  // namespace
}  // namespace estuary::aggregation
