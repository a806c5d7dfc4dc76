// The Coordinator's evaluation rounds (coordinator_eval.cc) with fake sites
// and fake time: who is asked, what the round log keeps, and that a site
// which does not evaluate, drops or stays silent holds nothing up beyond the
// deadline.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/server/fakes.h"

namespace estuary::server {
namespace {

using fake::CoordinatorRig;
using fake::FakeSession;
using std::chrono::seconds;

std::vector<v1::RoundStart> RoundStarts(const FakeSession& session) {
  std::vector<v1::RoundStart> starts;
  for (const auto& e : session.SentOf(v1::Envelope::kRoundStart)) starts.push_back(e.round_start());
  return starts;
}

std::vector<float> Filled(const CoordinatorRig& rig, float value) {
  return std::vector<float>(rig.manifest().total_elements, value);
}

void Report(CoordinatorRig& rig, const std::shared_ptr<FakeSession>& session, uint64_t round, bool supported,
            uint64_t examples = 0, double loss = 0, std::optional<double> accuracy = std::nullopt) {
  v1::Envelope envelope;
  v1::EvalReport* report = envelope.mutable_eval_report();
  report->set_round(round);
  report->set_supported(supported);
  report->set_num_examples(examples);
  report->set_loss(loss);
  report->set_has_accuracy(accuracy.has_value());
  report->set_accuracy(accuracy.value_or(0));
  rig.coordinator->OnMessage(session, envelope);
}

std::optional<RoundEvaluation> EvaluationOf(CoordinatorRig& rig, uint64_t round) {
  auto record = rig.store->GetRound(round);
  EXPECT_TRUE(record.ok() && record->has_value()) << "round " << round;
  return record.ok() && record->has_value() ? (*record)->evaluation : std::nullopt;
}

TEST(CoordinatorEvaluation, EvaluatingSitesScoreEachCommittedModelBeforeTheNextRound) {
  CoordinatorRig rig;
  rig.config.rounds = 2;
  rig.config.min_clients = 3;
  rig.config.clients_per_round = 3;
  rig.config.evaluate_every = 1;
  ASSERT_TRUE(rig.Start().ok());
  int completed = 0;
  rig.coordinator->set_on_complete([&] { ++completed; });
  auto a = rig.Connect("site-a", "01", false, /*evaluates=*/true);
  auto b = rig.Connect("site-b", "02", false, /*evaluates=*/true);
  auto old = rig.Connect("site-old");  // a site before evaluation rounds: never asked
  rig.FinishDownloads({a, b, old});
  for (const auto& site : {a, b, old}) rig.Upload(site, 1, Filled(rig, 1.0f));
  rig.executors.RunUntilIdle();

  // Round 1 committed; its evaluation round asks the two that evaluate.
  ASSERT_EQ(RoundStarts(*a).size(), 2u);
  const v1::RoundStart ask = RoundStarts(*a)[1];
  EXPECT_TRUE(ask.evaluate_only());
  EXPECT_EQ(ask.round(), 1u);
  EXPECT_EQ(ask.model_version(), 1u);
  EXPECT_TRUE(ask.model_follows());
  EXPECT_EQ(RoundStarts(*b).size(), 2u);
  EXPECT_EQ(RoundStarts(*old).size(), 1u);
  ASSERT_EQ(a->SentOf(v1::Envelope::kRoundClosed).size(), 1u);
  EXPECT_FALSE(a->SentOf(v1::Envelope::kRoundClosed)[0].round_closed().federation_complete());

  // A site not asked is refused; the round carries on.
  Report(rig, old, 1, true, 10, 0.1, 0.9);
  EXPECT_EQ(old->error, v1::Error::NOT_SELECTED);
  old->Close();
  old = rig.Connect("site-old");
  Report(rig, a, 1, true, 30, 0.5, 0.6);
  EXPECT_EQ(RoundStarts(*a).size(), 2u) << "round 2 waits for site-b's answer";
  Report(rig, b, 1, /*supported=*/false);
  auto one = EvaluationOf(rig, 1);
  ASSERT_TRUE(one.has_value());
  EXPECT_EQ(one->selected, 2u);
  EXPECT_EQ(one->reported, 1u);
  EXPECT_EQ(one->unsupported, 1u);
  EXPECT_EQ(one->failed, 0u);
  EXPECT_EQ(one->examples, 30u);
  EXPECT_EQ(one->loss, 0.5);
  EXPECT_EQ(one->accuracy, 0.6);

  // Round 2.
  ASSERT_EQ(RoundStarts(*a).size(), 3u);
  EXPECT_FALSE(RoundStarts(*a)[2].evaluate_only());
  EXPECT_EQ(RoundStarts(*a)[2].round(), 2u);
  rig.FinishDownloads({a, b, old});
  for (const auto& site : {a, b, old}) rig.Upload(site, 2, Filled(rig, 1.0f));
  rig.executors.RunUntilIdle();
  // The last round's RoundClosed leaves the federation open for its evaluation.
  ASSERT_EQ(a->SentOf(v1::Envelope::kRoundClosed).size(), 2u);
  EXPECT_FALSE(a->SentOf(v1::Envelope::kRoundClosed)[1].round_closed().federation_complete());
  EXPECT_FALSE(rig.coordinator->complete());
  EXPECT_EQ(completed, 0);
  ASSERT_EQ(RoundStarts(*b).size(), 4u);
  EXPECT_TRUE(RoundStarts(*b)[3].evaluate_only());
  // site-a answers; site-b stays silent until the deadline.
  Report(rig, a, 2, true, 40, 0.25, 0.75);
  rig.clock.Advance(seconds(59));
  EXPECT_FALSE(EvaluationOf(rig, 2).has_value()) << "site-b may still answer";
  rig.clock.Advance(seconds(1));
  auto two = EvaluationOf(rig, 2);
  ASSERT_TRUE(two.has_value());
  EXPECT_EQ(two->reported, 1u);
  EXPECT_EQ(two->failed, 1u);
  EXPECT_EQ(two->examples, 40u);
  EXPECT_EQ(two->accuracy, 0.75);
  EXPECT_EQ(two->seconds, 60.0);
  EXPECT_EQ(completed, 1);
  EXPECT_TRUE(rig.coordinator->complete());
  const auto closed = a->SentOf(v1::Envelope::kRoundClosed);
  ASSERT_EQ(closed.size(), 3u);
  EXPECT_TRUE(closed[2].round_closed().federation_complete());
  // A late answer is no error.
  Report(rig, b, 2, true, 10, 1, 0.5);
  EXPECT_FALSE(b->error.has_value());
}

TEST(CoordinatorEvaluation, ADroppedSiteCountsAsFailedAndOnlyDueRoundsAreEvaluated) {
  CoordinatorRig rig;
  rig.config.rounds = 3;
  rig.config.evaluate_every = 2;  // rounds 2 and 3 (the last)
  ASSERT_TRUE(rig.Start().ok());
  auto a = rig.Connect("site-a", "01", false, true);
  auto b = rig.Connect("site-b", "02", false, true);
  for (uint64_t round = 1; round <= 3; ++round) {
    rig.FinishDownloads({a, b});
    rig.Upload(a, round, Filled(rig, 1.0f));
    rig.Upload(b, round, Filled(rig, 1.0f));
    rig.executors.RunUntilIdle();
    if (round == 1) {
      EXPECT_FALSE(RoundStarts(*a).back().evaluate_only()) << "round 1 is not due";
      continue;
    }
    ASSERT_TRUE(RoundStarts(*a).back().evaluate_only()) << "round " << round;
    Report(rig, a, round, true, 20, 0.5, 0.5);
    if (round == 2) {
      b->Close();  // gone mid-evaluation: failed, and the next round goes on without it
      b = rig.Connect("site-b", "02", false, true);
    } else {
      Report(rig, b, round, true, 60, 1.0, 0.25);
    }
  }
  EXPECT_FALSE(EvaluationOf(rig, 1).has_value());
  auto two = EvaluationOf(rig, 2), three = EvaluationOf(rig, 3);
  ASSERT_TRUE(two && three);
  EXPECT_EQ(two->failed, 1u);
  EXPECT_EQ(two->reported, 1u);
  EXPECT_EQ(three->reported, 2u);
  EXPECT_EQ(three->examples, 80u);
  EXPECT_DOUBLE_EQ(three->loss, (20 * 0.5 + 60 * 1.0) / 80);
  EXPECT_DOUBLE_EQ(*three->accuracy, (20 * 0.5 + 60 * 0.25) / 80);
  EXPECT_TRUE(rig.coordinator->complete());
}

}  // namespace
}  // namespace estuary::server
