// Federated evaluation's arithmetic (server/evaluation.h), against the
// pooled counts it must equal: the example-weighted mean of per-site means is
// the mean over the union of their examples.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "server/evaluation.h"

namespace estuary::server {
namespace {

using Outcome = SiteEvaluation::Outcome;

TEST(Evaluation, TheWeightedMeanIsThePooledMeanAndOtherSitesAreCountedApart) {
  // Per-site held-out sets as (examples, correct, summed loss): the pooled
  // accuracy and loss are the totals' ratios.
  struct Site {
    uint64_t examples, correct;
    double loss_sum;
  };
  const Site a{30, 21, 12.0}, b{50, 45, 9.5}, c{7, 1, 14.0};
  std::vector<SiteEvaluation> sites = {
      {Outcome::kEvaluated, a.examples, a.loss_sum / a.examples, double(a.correct) / a.examples},
      {Outcome::kUnsupported, 0, 0, std::nullopt},
      {Outcome::kEvaluated, b.examples, b.loss_sum / b.examples, double(b.correct) / b.examples},
      {Outcome::kFailed, 0, 0, std::nullopt},
      // A model without an accuracy: its loss counts, and only that.
      {Outcome::kEvaluated, c.examples, c.loss_sum / c.examples, std::nullopt},
  };
  const RoundEvaluation e = AggregateEvaluations(sites, 2.5);
  EXPECT_EQ(e.selected, 5u);
  EXPECT_EQ(e.reported, 3u);
  EXPECT_EQ(e.unsupported, 1u);
  EXPECT_EQ(e.failed, 1u);
  EXPECT_EQ(e.examples, a.examples + b.examples + c.examples);
  EXPECT_NEAR(e.loss, (a.loss_sum + b.loss_sum + c.loss_sum) / double(a.examples + b.examples + c.examples), 1e-15);
  ASSERT_TRUE(e.accuracy.has_value());
  EXPECT_EQ(e.accuracy_examples, a.examples + b.examples);
  EXPECT_NEAR(*e.accuracy, double(a.correct + b.correct) / double(a.examples + b.examples), 1e-15);
  EXPECT_EQ(e.seconds, 2.5);
}

TEST(Evaluation, AnswersThatCannotBeWeighedFailAndNoAnswerGivesNoMetric) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const RoundEvaluation e = AggregateEvaluations({{Outcome::kEvaluated, 0, 0.5, 0.5},
                                                  {Outcome::kEvaluated, 10, nan, 0.5},
                                                  {Outcome::kEvaluated, 10, 0.5, std::numeric_limits<double>::infinity()},
                                                  {Outcome::kUnsupported, 10, 0.5, 0.5}},
                                                 1);
  EXPECT_EQ(e.selected, 4u);
  EXPECT_EQ(e.reported, 0u);
  EXPECT_EQ(e.failed, 3u);
  EXPECT_EQ(e.unsupported, 1u);
  EXPECT_EQ(e.examples, 0u);
  EXPECT_EQ(e.loss, 0);
  EXPECT_FALSE(e.accuracy.has_value());
}

TEST(Evaluation, ItIsDueEveryNRoundsAndAfterTheLast) {
  std::vector<uint64_t> due;
  for (uint64_t r = 0; r <= 8; ++r) {
    if (EvaluationDue(r, 3, 7)) due.push_back(r);
  }
  EXPECT_EQ(due, (std::vector<uint64_t>{3, 6, 7}));
  for (uint64_t r = 0; r <= 8; ++r) EXPECT_FALSE(EvaluationDue(r, 0, 7)) << r;
  EXPECT_NE(EvaluationSeed(1), 1u);
  EXPECT_NE(EvaluationSeed(1), EvaluationSeed(2));
}

}  // namespace
}  // namespace estuary::server
