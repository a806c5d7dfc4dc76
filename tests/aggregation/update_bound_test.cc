// The federation's limits on one update (aggregation/update_bound.h).
#include "aggregation/update_bound.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace estuary::aggregation {
namespace {

v1::UpdateLimits Limits(double max_norm, double over_median, uint64_t max_examples = 0) {
  v1::UpdateLimits limits;
  limits.set_max_norm(max_norm);
  limits.set_max_norm_over_median(over_median);
  limits.set_max_examples(max_examples);
  return limits;
}

// An update of n values all equal to v: its L2 norm is |v|·√n.
std::vector<float> Of(size_t n, float v) { return std::vector<float>(n, v); }

TEST(UpdateBound, WithinTheBoundAnUpdateIsFoldedAsItIs) {
  UpdateBound bound(Limits(10, 0));
  bound.BeginRound();
  EXPECT_EQ(bound.bound(), 10);
  const auto values = Of(4, 2.0f);  // norm 4
  auto admitted = bound.Admit(values, 7);
  ASSERT_TRUE(admitted.ok());
  EXPECT_DOUBLE_EQ(admitted->norm(), 4);
  EXPECT_EQ(admitted->scale(), 1);
  EXPECT_EQ(admitted->values().data(), values.data()) << "no copy for an update within the bound";
  EXPECT_EQ(admitted->note(), "");
}

TEST(UpdateBound, BeyondTheBoundAnUpdateIsScaledDownToItExactly) {
  UpdateBound bound(Limits(10, 0));
  bound.BeginRound();
  auto admitted = bound.Admit(Of(100, 1e30f), 7);  // norm 1e31
  ASSERT_TRUE(admitted.ok());
  EXPECT_NEAR(admitted->norm(), 1e31, 1e24);  // 1e30f is not exactly 1e30
  double squares = 0;
  for (float v : admitted->values()) squares += double(v) * v;
  EXPECT_NEAR(std::sqrt(squares), 10.0, 1e-5);
  EXPECT_EQ(admitted->note(), "norm 1e+31 scaled down to the bound 10");
}

TEST(UpdateBound, TheRelativeBoundFollowsTheLastCommittedRoundsMedianAsFolded) {
  UpdateBound bound(Limits(0, 3));
  bound.BeginRound();
  EXPECT_EQ(bound.bound(), 0) << "no median yet: the first round has only the absolute bound";
  for (float v : {1.0f, 2.0f, 1000.0f}) ASSERT_TRUE(bound.Admit(Of(1, v), 1).ok());  // norms 1, 2, 1000
  bound.BeginRound();  // a round that did not commit leaves the median as it was
  EXPECT_EQ(bound.bound(), 0);
  for (float v : {1.0f, 2.0f, 1000.0f}) ASSERT_TRUE(bound.Admit(Of(1, v), 1).ok());
  bound.CommitRound();
  bound.BeginRound();
  EXPECT_DOUBLE_EQ(bound.bound(), 6) << "3 × the median 2: the outlier does not move it";
  ASSERT_TRUE(bound.Admit(Of(1, 1e9f), 1).ok());  // folded at 6
  ASSERT_TRUE(bound.Admit(Of(1, 1e9f), 1).ok());
  ASSERT_TRUE(bound.Admit(Of(1, 1.0f), 1).ok());
  bound.CommitRound();
  bound.BeginRound();
  EXPECT_DOUBLE_EQ(bound.bound(), 18) << "3 × the median of 6, 6, 1 as folded, not of 1e9";

  UpdateBound both(Limits(5, 3));
  ASSERT_TRUE(both.LoadState(bound.SaveState()).ok());
  both.BeginRound();
  EXPECT_DOUBLE_EQ(both.bound(), 5) << "the smaller of the two";
}

TEST(UpdateBound, ItsMedianSurvivesARestart) {
  UpdateBound bound(Limits(0, 2));
  bound.BeginRound();
  for (float v : {0.3f, 0.7f}) ASSERT_TRUE(bound.Admit(Of(1, v), 1).ok());
  bound.CommitRound();
  UpdateBound restarted(Limits(0, 2));
  ASSERT_TRUE(restarted.LoadState(bound.SaveState()).ok());
  bound.BeginRound();
  restarted.BeginRound();
  EXPECT_EQ(restarted.bound(), bound.bound());
  EXPECT_NEAR(bound.bound(), 1.0, 1e-7);
  EXPECT_FALSE(restarted.LoadState({{"update_bound/median_norm", {-1}}}).ok());
}

TEST(UpdateBound, ClaimsBeyondTheCapAndUpdatesThatAreNotFiniteAreRefused) {
  UpdateBound bound(Limits(0, 0, 100));
  bound.BeginRound();
  EXPECT_TRUE(bound.Admit(Of(3, 1), 100).ok());
  auto greedy = bound.Admit(Of(3, 1), 101);
  ASSERT_FALSE(greedy.ok());
  EXPECT_EQ(greedy.status().message(), "update claims 101 examples, beyond the federation's max_examples of 100");
  std::vector<float> broken = Of(3, 1);
  broken[1] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(bound.Admit(broken, 1).ok());
}

}  // namespace
}  // namespace estuary::aggregation
