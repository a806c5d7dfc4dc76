// The Coordinator's rounds with fake sites, fake time and the worker run by
// the test: the state machine as the round log records it.
#include <gtest/gtest.h>

#include "base/seed.h"

#include <algorithm>
#include <string>
#include <vector>

#include "aggregation/sampling.h"
#include "crypto/sha256.h"
#include "models/checkpoint.h"
#include "privacy/accountant.h"
#include "proto/wire.h"
#include "tests/server/fakes.h"

namespace estuary::server {
namespace {

using fake::CoordinatorRig;
using fake::FakeSession;
using std::chrono::milliseconds;
using std::chrono::seconds;
using Sessions = std::vector<std::shared_ptr<FakeSession>>;

std::string Checksum(const std::vector<float>& values) {
  return crypto::Sha256Hex(values.data(), values.size() * sizeof(float));
}

// FedAvg's arithmetic on a delta the same everywhere: global + mean, in double.
std::vector<float> Plus(const std::vector<float>& global, double mean) {
  std::vector<float> out(global.size());
  for (size_t i = 0; i < global.size(); ++i) out[i] = float(double(global[i]) + mean);
  return out;
}

std::vector<float> Filled(const CoordinatorRig& rig, float value) {
  return std::vector<float>(rig.manifest().total_elements, value);
}

RoundRecord RoundOf(CoordinatorRig& rig, uint64_t round) {
  auto record = rig.store->GetRound(round);
  EXPECT_TRUE(record.ok() && record->has_value()) << "round " << round;
  return record.ok() && record->has_value() ? **record : RoundRecord{};
}

std::map<std::string, Participation> ParticipationsOf(CoordinatorRig& rig, uint64_t round) {
  std::map<std::string, Participation> by_name;
  auto rows = rig.store->Participations(round);
  EXPECT_TRUE(rows.ok());
  if (rows.ok()) {
    for (const auto& p : *rows) by_name[p.client] = p;
  }
  return by_name;
}

std::vector<std::string> EventDetails(CoordinatorRig& rig, const std::string& kind) {
  std::vector<std::string> details;
  auto events = rig.store->Events();
  EXPECT_TRUE(events.ok());
  if (events.ok()) {
    for (const auto& e : *events) {
      if (e.kind == kind) details.push_back(e.detail);
    }
  }
  return details;
}

std::vector<v1::RoundStart> RoundStarts(const FakeSession& session) {
  std::vector<v1::RoundStart> starts;
  for (const auto& e : session.SentOf(v1::Envelope::kRoundStart)) starts.push_back(e.round_start());
  return starts;
}

std::vector<std::string> States(CoordinatorRig& rig, uint64_t round) {
  std::vector<std::string> states;
  auto transitions = rig.store->Transitions(round);
  EXPECT_TRUE(transitions.ok());
  if (transitions.ok()) {
    for (const auto& t : *transitions) states.push_back(std::string(RoundStateName(t.to)));
  }
  return states;
}

TEST(Coordinator, ARoundOpensWhenMinClientsAreConnectedAndSamplesWithTheSeed) {
  CoordinatorRig rig;
  rig.config.min_clients = 5;
  rig.config.clients_per_round = 3;
  rig.config.federation.mutable_task()->set_seed(7);
  ASSERT_TRUE(rig.Start().ok());
  Sessions sites;
  std::vector<std::string> names;
  for (int i = 0; i < 4; ++i) {
    names.push_back("site-" + std::to_string(i));
    sites.push_back(rig.Connect(names.back()));
  }
  for (const auto& site : sites) {
    EXPECT_EQ(site->SentOf(v1::Envelope::kWelcome).size(), 1u);
    EXPECT_TRUE(RoundStarts(*site).empty()) << "four of five connected: no round yet";
  }
  EXPECT_TRUE(rig.store->Rounds()->empty());

  names.push_back("site-4");
  sites.push_back(rig.Connect("site-4"));
  const std::vector<std::string> sampled = aggregation::SampleClients(names, 3, 7, 1);
  std::vector<std::string> selected;
  for (const auto& site : sites) {
    const auto starts = RoundStarts(*site);
    if (starts.empty()) continue;
    selected.push_back(site->name());
    ASSERT_EQ(starts.size(), 1u);
    EXPECT_EQ(starts[0].round(), 1u);
    EXPECT_EQ(starts[0].model_version(), 0u);
    EXPECT_EQ(starts[0].model_checksum(), Checksum(rig.initial()));
    EXPECT_TRUE(starts[0].model_follows());
    EXPECT_EQ(starts[0].patch_size(), 0);
    EXPECT_EQ(starts[0].task().seed(), 7u);
    EXPECT_EQ(starts[0].deadline_unix_ms(), rig.clock.UnixMs() + 60'000);
  }
  EXPECT_EQ(selected, sampled);

  const RoundRecord round = RoundOf(rig, 1);
  EXPECT_EQ(round.state, RoundState::kCollecting);
  EXPECT_EQ(round.clients_selected, 3u);
  EXPECT_EQ(States(rig, 1), std::vector<std::string>{"collecting"});
  const auto participations = ParticipationsOf(rig, 1);
  ASSERT_EQ(participations.size(), 3u);
  for (const auto& [name, p] : participations) {
    EXPECT_EQ(p.status, "selected");
    EXPECT_EQ(p.bytes_down, rig.manifest().byte_size());
  }
}

TEST(Coordinator, AFullRoundOfSitesCommitsToTheStoreAndWritesTheCheckpoint) {
  CoordinatorRig rig;
  ASSERT_TRUE(rig.Start().ok());
  auto a = rig.Connect("site-a");
  auto b = rig.Connect("site-b");
  ASSERT_EQ(a->models.size(), 1u);
  EXPECT_EQ(*a->models[0].model, rig.initial());
  EXPECT_TRUE(a->models[0].ranges.empty()) << "the whole model";
  rig.FinishDownloads({a, b});

  rig.Upload(a, 1, Filled(rig, 1.0f), 10, 2.0);
  EXPECT_TRUE(a->SentOf(v1::Envelope::kUpdateAck).empty()) << "not folded before the worker runs";
  EXPECT_EQ(ParticipationsOf(rig, 1)["site-a"].status, "selected");
  rig.executors.RunUntilIdle();
  EXPECT_EQ(ParticipationsOf(rig, 1)["site-a"].status, "committed");
  ASSERT_EQ(a->SentOf(v1::Envelope::kUpdateAck).size(), 1u);
  EXPECT_TRUE(a->SentOf(v1::Envelope::kUpdateAck)[0].update_ack().accepted());
  EXPECT_EQ(RoundOf(rig, 1).state, RoundState::kCollecting);

  rig.Upload(b, 1, Filled(rig, 3.0f), 10, 4.0);
  rig.executors.RunUntilIdle();
  const std::vector<float> expected = Plus(rig.initial(), 2.0);
  const RoundRecord round = RoundOf(rig, 1);
  EXPECT_EQ(round.state, RoundState::kCommitted);
  EXPECT_EQ(round.model_version, 1u);
  EXPECT_EQ(round.global_checksum, Checksum(expected));
  EXPECT_EQ(round.updates_received, 2u);
  EXPECT_EQ(round.train_loss, 3.0);
  EXPECT_EQ(round.bytes_up, 2 * rig.manifest().byte_size());
  EXPECT_EQ(States(rig, 1), (std::vector<std::string>{"collecting", "aggregating", "committed"}));
  for (const auto& [name, p] : ParticipationsOf(rig, 1)) EXPECT_EQ(p.status, "committed") << name;

  auto path = rig.store->CheckpointFor(1);
  ASSERT_TRUE(path.ok() && path->has_value());
  EXPECT_EQ(**path, (rig.config.checkpoint_dir / "global-r00001.safetensors").string());
  auto checkpoint = models::LoadCheckpoint(**path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_EQ(checkpoint->data, expected);
  EXPECT_EQ(checkpoint->metadata["sha256"], Checksum(expected));
  EXPECT_EQ(checkpoint->metadata["round"], "1");
  EXPECT_EQ(checkpoint->metadata["strategy"], "fedavg");

  for (const auto& site : {a, b}) {
    const auto closed = site->SentOf(v1::Envelope::kRoundClosed);
    ASSERT_EQ(closed.size(), 1u);
    EXPECT_TRUE(closed[0].round_closed().committed());
    EXPECT_EQ(closed[0].round_closed().model_version(), 1u);
    EXPECT_EQ(closed[0].round_closed().model_checksum(), Checksum(expected));
    EXPECT_FALSE(closed[0].round_closed().federation_complete());
    // The next round follows at once, from the new model.
    const auto starts = RoundStarts(*site);
    ASSERT_EQ(starts.size(), 2u);
    EXPECT_EQ(starts[1].round(), 2u);
    EXPECT_EQ(starts[1].model_version(), 1u);
    EXPECT_EQ(starts[1].model_checksum(), Checksum(expected));
  }
  EXPECT_EQ(rig.coordinator->round(), 2u);
}

TEST(Coordinator, ARestartResumesAfterTheLastCommittedRound) {
  CoordinatorRig rig;
  ASSERT_TRUE(rig.Start().ok());
  auto a = rig.Connect("site-a");
  auto b = rig.Connect("site-b");
  rig.FinishDownloads({a, b});
  rig.Upload(a, 1, Filled(rig, 1.0f));
  rig.Upload(b, 1, Filled(rig, 1.0f));
  rig.executors.RunUntilIdle();
  ASSERT_EQ(RoundOf(rig, 1).state, RoundState::kCommitted);

  rig.coordinator.reset();
  ASSERT_TRUE(rig.Start().ok());
  EXPECT_EQ(rig.coordinator->round(), 2u);
  auto c = rig.Connect("site-c");
  rig.Connect("site-d");
  const auto starts = RoundStarts(*c);
  ASSERT_EQ(starts.size(), 1u);
  EXPECT_EQ(starts[0].round(), 2u);
  EXPECT_EQ(starts[0].model_version(), 1u);
  EXPECT_EQ(starts[0].model_checksum(), Checksum(Plus(rig.initial(), 1.0)));
}

TEST(Coordinator, AfterTheLastRoundTheFederationIsCompleteAndLateSitesAreToldSo) {
  CoordinatorRig rig;
  rig.config.rounds = 1;
  ASSERT_TRUE(rig.Start().ok());
  int completed = 0;
  rig.coordinator->set_on_complete([&] { ++completed; });
  auto a = rig.Connect("site-a");
  auto b = rig.Connect("site-b");
  rig.FinishDownloads({a, b});
  rig.Upload(a, 1, Filled(rig, 1.0f));
  rig.Upload(b, 1, Filled(rig, 1.0f));
  EXPECT_EQ(completed, 0);
  rig.executors.RunUntilIdle();
  EXPECT_EQ(completed, 1);
  EXPECT_TRUE(rig.coordinator->complete());
  ASSERT_EQ(a->SentOf(v1::Envelope::kRoundClosed).size(), 1u);
  EXPECT_TRUE(a->SentOf(v1::Envelope::kRoundClosed)[0].round_closed().federation_complete());
  EXPECT_EQ(RoundStarts(*a).size(), 1u) << "no round after the last";

  auto late = rig.Connect("site-c");
  EXPECT_EQ(late->SentOf(v1::Envelope::kWelcome).size(), 1u);
  EXPECT_TRUE(RoundStarts(*late).empty());
  const auto closed = late->SentOf(v1::Envelope::kRoundClosed);
  ASSERT_EQ(closed.size(), 1u);
  EXPECT_TRUE(closed[0].round_closed().federation_complete());
  EXPECT_EQ(closed[0].round_closed().round(), 1u);
  EXPECT_EQ(closed[0].round_closed().model_version(), 1u);
  EXPECT_EQ(closed[0].round_closed().model_checksum(), Checksum(Plus(rig.initial(), 1.0)));
}

// DP-FedAvg: two of four connected sites a round (q = 0.5), noise multiplier
// 1. Each committed round's ε is the accountant's for that many rounds, and a
// budget between ε after 2 and after 3 rounds stops the federation before
// round 3, again after a restart (which replays the log into the accountant).
TEST(Coordinator, ADpRoundLogsTheAccountantsEpsilonAndTheBudgetStopsTheFederation) {
  constexpr double kQ = 0.5, kZ = 1.0, kDelta = 1e-5;
  auto two = privacy::EpsilonAfterRounds(kQ, kZ, 2, kDelta);
  auto three = privacy::EpsilonAfterRounds(kQ, kZ, 3, kDelta);
  ASSERT_TRUE(two.ok() && three.ok());
  CoordinatorRig rig;
  rig.config.rounds = 5;
  rig.config.min_clients = 4;
  v1::DpConfig& dp = *rig.config.federation.mutable_dp();
  dp.set_noise_multiplier(kZ);
  dp.set_clip(0.5);
  dp.set_delta(kDelta);
  dp.set_max_epsilon((two->epsilon + three->epsilon) / 2);
  ASSERT_TRUE(rig.Start().ok());
  int completed = 0;
  rig.coordinator->set_on_complete([&] { ++completed; });
  Sessions sites;
  for (const char* name : {"site-a", "site-b", "site-c", "site-d"}) sites.push_back(rig.Connect(name));
  auto run_round = [&](uint64_t round) {
    rig.FinishDownloads(sites);
    for (const auto& site : sites) {
      const auto starts = RoundStarts(*site);
      if (!starts.empty() && starts.back().round() == round) rig.Upload(site, round, Filled(rig, 0.01f));
    }
    rig.executors.RunUntilIdle();
  };
  run_round(1);
  run_round(2);
  for (uint64_t round : {1, 2}) {
    const RoundRecord record = RoundOf(rig, round);
    ASSERT_EQ(record.state, RoundState::kCommitted) << round;
    ASSERT_TRUE(record.privacy.has_value()) << round;
    auto expected = privacy::EpsilonAfterRounds(kQ, kZ, int64_t(round), kDelta);
    ASSERT_TRUE(expected.ok());
    EXPECT_DOUBLE_EQ(record.privacy->epsilon, expected->epsilon) << round;
    EXPECT_EQ(record.privacy->sampling_rate, kQ);
    EXPECT_EQ(record.privacy->clip, 0.5);
    EXPECT_DOUBLE_EQ(record.privacy->noise_stddev, kZ * 0.5);
    EXPECT_EQ(record.strategy, "fedavg+dp");
  }
  EXPECT_EQ(completed, 1);
  EXPECT_TRUE(rig.coordinator->complete());
  EXPECT_FALSE(rig.store->GetRound(3)->has_value()) << "round 3 never opened";
  for (const auto& site : sites) {
    const auto closed = site->SentOf(v1::Envelope::kRoundClosed);
    ASSERT_FALSE(closed.empty());
    EXPECT_TRUE(closed.back().round_closed().federation_complete());
  }

  rig.coordinator.reset();
  ASSERT_TRUE(rig.Start().ok());
  Sessions again;
  for (const char* name : {"site-a", "site-b", "site-c", "site-d"}) again.push_back(rig.Connect(name));
  for (const auto& site : again) {
    EXPECT_TRUE(RoundStarts(*site).empty());
    const auto closed = site->SentOf(v1::Envelope::kRoundClosed);
    ASSERT_FALSE(closed.empty());
    EXPECT_TRUE(closed.back().round_closed().federation_complete());
    EXPECT_EQ(closed.back().round_closed().round(), 2u) << "the last round that ran, not the 5 planned";
  }
  EXPECT_TRUE(rig.coordinator->complete());
  EXPECT_FALSE(rig.store->GetRound(3)->has_value());
}

// A restart must keep the federation's privacy as its log recorded it: a
// plaintext log refuses DP flags, and a DP log refuses a start without them.
TEST(Coordinator, DifferentialPrivacyCannotBeTurnedOnOrOffMidway) {
  auto commit_round_one = [](CoordinatorRig& rig) {
    ASSERT_TRUE(rig.Start().ok());
    auto a = rig.Connect("site-a");
    auto b = rig.Connect("site-b");
    rig.FinishDownloads({a, b});
    rig.Upload(a, 1, Filled(rig, 0.01f));
    rig.Upload(b, 1, Filled(rig, 0.01f));
    rig.executors.RunUntilIdle();
    ASSERT_EQ(RoundOf(rig, 1).state, RoundState::kCommitted);
    rig.coordinator.reset();
  };
  auto with_dp = [](CoordinatorRig& rig) {
    v1::DpConfig& dp = *rig.config.federation.mutable_dp();
    dp.set_noise_multiplier(1.0);
    dp.set_clip(0.5);
    dp.set_delta(1e-5);
  };
  {
    CoordinatorRig rig;
    commit_round_one(rig);
    with_dp(rig);
    const Status status = rig.Start();
    ASSERT_FALSE(status.ok());
    EXPECT_NE(status.message().find("round 1 committed without differential privacy"), std::string::npos)
        << status.message();
  }
  {
    CoordinatorRig rig;
    with_dp(rig);
    commit_round_one(rig);
    ASSERT_TRUE(RoundOf(rig, 1).privacy.has_value());
    rig.config.federation.clear_dp();
    const Status status = rig.Start();
    ASSERT_FALSE(status.ok());
    EXPECT_NE(status.message().find("round 1 committed under differential privacy (noise multiplier 1)"),
              std::string::npos)
        << status.message();
    with_dp(rig);
    const Status resumed = rig.Start();
    EXPECT_TRUE(resumed.ok()) << "the same settings resume: " << resumed.message();
  }
}

TEST(Coordinator, TheDeadlineMarksSilentSitesLateAndAggregatesWithMinUpdates) {
  CoordinatorRig rig;
  rig.config.min_clients = 3;
  rig.config.clients_per_round = 3;
  rig.config.min_updates = 2;
  ASSERT_TRUE(rig.Start().ok());
  auto a = rig.Connect("site-a");
  auto b = rig.Connect("site-b");
  auto c = rig.Connect("site-c");
  rig.FinishDownloads({a, b, c});
  rig.Upload(a, 1, Filled(rig, 1.0f));
  rig.Upload(b, 1, Filled(rig, 3.0f));
  rig.executors.RunUntilIdle();
  EXPECT_EQ(RoundOf(rig, 1).state, RoundState::kCollecting) << "site-c has not answered";

  rig.clock.Advance(seconds(59));
  EXPECT_EQ(ParticipationsOf(rig, 1)["site-c"].status, "selected");
  rig.clock.Advance(seconds(1));
  const Participation late = ParticipationsOf(rig, 1)["site-c"];
  EXPECT_EQ(late.status, "late");
  EXPECT_EQ(late.detail, "no update before the deadline");
  EXPECT_EQ(late.seconds, 60.0);
  rig.executors.RunUntilIdle();
  const RoundRecord round = RoundOf(rig, 1);
  EXPECT_EQ(round.state, RoundState::kCommitted);
  EXPECT_EQ(round.updates_received, 2u);
  EXPECT_EQ(round.global_checksum, Checksum(Plus(rig.initial(), 2.0)));
}

// A site whose training failed says why (SiteRefusal with stays): recorded
// failed with its line, the round commits without waiting for the deadline,
// and the site stays connected for the next round.
TEST(Coordinator, ASiteWhoseTrainingFailedIsRecordedWithItsReasonAndTheRoundDoesNotWaitForIt) {
  CoordinatorRig rig;
  rig.config.min_clients = 3;
  rig.config.clients_per_round = 3;
  rig.config.min_updates = 2;
  ASSERT_TRUE(rig.Start().ok());
  auto a = rig.Connect("site-a");
  auto b = rig.Connect("site-b");
  auto c = rig.Connect("site-c");
  rig.FinishDownloads({a, b, c});
  rig.Upload(a, 1, Filled(rig, 1.0f));
  rig.Upload(b, 1, Filled(rig, 3.0f));
  v1::Envelope failed;
  failed.mutable_refusal()->set_round(1);
  failed.mutable_refusal()->set_reason("round 1: the trainer threw: fit raised ValueError: no data");
  failed.mutable_refusal()->set_stays(true);
  rig.coordinator->OnMessage(c, failed);
  rig.executors.RunUntilIdle();
  const Participation p = ParticipationsOf(rig, 1)["site-c"];
  EXPECT_EQ(p.status, "failed");
  EXPECT_EQ(p.detail, "round 1: the trainer threw: fit raised ValueError: no data");
  EXPECT_EQ(RoundOf(rig, 1).state, RoundState::kCommitted) << "no wait for the deadline";
  EXPECT_EQ(RoundOf(rig, 1).updates_received, 2u);
  EXPECT_FALSE(c->closing() || c->closed()) << "the site stays for the next round";
  rig.executors.RunUntilIdle();
  EXPECT_EQ(ParticipationsOf(rig, 2)["site-c"].status, "selected");
}

TEST(Coordinator, ARoundShortOfMinUpdatesAtTheDeadlineFailsAndIsRetriedAfterThePause) {
  CoordinatorRig rig;
  rig.config.min_updates = 2;
  ASSERT_TRUE(rig.Start().ok());
  auto a = rig.Connect("site-a");
  auto b = rig.Connect("site-b");
  rig.FinishDownloads({a, b});
  rig.Upload(a, 1, Filled(rig, 1.0f));
  rig.executors.RunUntilIdle();

  rig.clock.Advance(seconds(60));
  RoundRecord round = RoundOf(rig, 1);
  EXPECT_EQ(round.state, RoundState::kFailed);
  EXPECT_EQ(round.detail, "1 of 2 updates received, 2 needed");
  for (const auto& site : {a, b}) {
    const auto closed = site->SentOf(v1::Envelope::kRoundClosed);
    ASSERT_EQ(closed.size(), 1u);
    EXPECT_FALSE(closed[0].round_closed().committed());
    EXPECT_EQ(closed[0].round_closed().detail(), round.detail);
  }

  rig.clock.Advance(milliseconds(999));
  EXPECT_EQ(RoundStarts(*a).size(), 1u) << "not retried before the pause is over";
  rig.clock.Advance(milliseconds(1));
  for (const auto& site : {a, b}) {
    const auto starts = RoundStarts(*site);
    ASSERT_EQ(starts.size(), 2u);
    EXPECT_EQ(starts[1].round(), 1u) << "the same round number";
    EXPECT_TRUE(starts[1].model_follows()) << "sent, but never confirmed by an update from a site that keeps it";
  }
  EXPECT_EQ(RoundOf(rig, 1).state, RoundState::kCollecting);
  rig.Upload(a, 1, Filled(rig, 1.0f));
  rig.Upload(b, 1, Filled(rig, 3.0f));
  rig.executors.RunUntilIdle();
  round = RoundOf(rig, 1);
  EXPECT_EQ(round.state, RoundState::kCommitted);
  EXPECT_EQ(round.global_checksum, Checksum(Plus(rig.initial(), 2.0))) << "only the retry's updates";
}

// Before: a failed round was retried with the same seed, so with the same
// sites, and failed again for as long as a selected site stayed silent. Each
// retry now draws with the seed mixed with its count, which a restart
// recovers from the round log.
TEST(Coordinator, ARetriedRoundDrawsItsSitesAnewAndARestartKeepsTheCount) {
  CoordinatorRig rig;
  rig.config.min_clients = 4;
  rig.config.clients_per_round = 2;
  rig.config.min_updates = 2;
  rig.config.federation.mutable_task()->set_seed(7);
  ASSERT_TRUE(rig.Start().ok());
  const std::vector<std::string> names = {"site-0", "site-1", "site-2", "site-3"};
  Sessions sites;
  for (const auto& name : names) sites.push_back(rig.Connect(name));
  // The sites a RoundStart reached since `before` (RoundStarts counted per site).
  auto started_since = [](const Sessions& of, const std::map<std::string, size_t>& before) {
    std::vector<std::string> started;
    for (const auto& site : of) {
      const auto it = before.find(site->name());
      if (RoundStarts(*site).size() > (it == before.end() ? 0 : it->second)) started.push_back(site->name());
    }
    return started;
  };
  auto counts = [](const Sessions& of) {
    std::map<std::string, size_t> n;
    for (const auto& site : of) n[site->name()] = RoundStarts(*site).size();
    return n;
  };
  const auto first = aggregation::SampleClients(names, 2, 7, 1);
  const auto second = aggregation::SampleClients(names, 2, MixSeed(7, 1), 1);
  const auto third = aggregation::SampleClients(names, 2, MixSeed(7, 2), 1);
  ASSERT_NE(first, second) << "seed 7 draws the same pair twice: pick another for this test";
  EXPECT_EQ(started_since(sites, {}), first);

  // Nobody uploads: the round fails at the deadline and is tried again a second later.
  rig.clock.Advance(seconds(60));
  ASSERT_EQ(RoundOf(rig, 1).state, RoundState::kFailed);
  const auto before_retry = counts(sites);
  rig.clock.Advance(seconds(1));
  EXPECT_EQ(RoundOf(rig, 1).state, RoundState::kCollecting);
  EXPECT_EQ(started_since(sites, before_retry), second);

  // The second try fails too; the server restarts before the third.
  rig.clock.Advance(seconds(60));
  ASSERT_EQ(RoundOf(rig, 1).state, RoundState::kFailed);
  rig.coordinator.reset();
  ASSERT_TRUE(rig.Start().ok());
  Sessions again;
  for (const auto& name : names) again.push_back(rig.Connect(name));
  EXPECT_EQ(started_since(again, {}), third);
}

// Before: a retried round told sites that never received the
// model that they held it. Only an update confirms the version it trained on.
TEST(Coordinator, ARetriedRoundSendsTheModelToEverySiteThatDidNotConfirmIt) {
  CoordinatorRig rig;
  rig.config.min_updates = 3;
  rig.config.clients_per_round = 3;
  rig.config.min_clients = 3;
  ASSERT_TRUE(rig.Start().ok());
  auto uploader = rig.Connect("site-a", "01", /*keeps_model=*/true);
  auto reader = rig.Connect("site-b", "01", /*keeps_model=*/true);
  auto stalled = rig.Connect("site-c", "01", /*keeps_model=*/true);
  // site-a and site-b receive the whole model; site-c's download never ends.
  rig.FinishDownloads({uploader, reader});
  EXPECT_TRUE(stalled->downloading());
  rig.Upload(uploader, 1, Filled(rig, 1.0f));
  rig.executors.RunUntilIdle();
  rig.clock.Advance(seconds(60));
  ASSERT_EQ(RoundOf(rig, 1).state, RoundState::kFailed);
  rig.clock.Advance(seconds(1));
  auto retried = [](const FakeSession& site) {
    const auto starts = RoundStarts(site);
    return starts.size() == 2 ? starts[1] : v1::RoundStart();
  };
  EXPECT_EQ(retried(*uploader).round(), 1u);
  EXPECT_FALSE(retried(*uploader).model_follows()) << "its update confirmed the version";
  EXPECT_TRUE(retried(*reader).model_follows()) << "written to its socket, never confirmed";
  EXPECT_TRUE(retried(*stalled).model_follows()) << "never received";
}

TEST(Coordinator, DuplicateOutOfRoundAndUnselectedUpdatesAreRejectedAndTheRoundCarriesOn) {
  CoordinatorRig rig;
  rig.config.min_clients = 4;
  rig.config.clients_per_round = 3;
  ASSERT_TRUE(rig.Start().ok());
  Sessions selected, unselected;
  Sessions sites;
  for (const char* name : {"site-a", "site-b", "site-c", "site-d"}) sites.push_back(rig.Connect(name));
  for (const auto& site : sites) (RoundStarts(*site).empty() ? unselected : selected).push_back(site);
  ASSERT_EQ(selected.size(), 3u);
  ASSERT_EQ(unselected.size(), 1u);
  rig.FinishDownloads(sites);

  rig.Begin(unselected[0], 1);
  EXPECT_EQ(unselected[0]->error, v1::Error::NOT_SELECTED);
  rig.Begin(selected[0], 2);
  EXPECT_EQ(selected[0]->error, v1::Error::ROUND_NOT_OPEN);
  EXPECT_EQ(selected[0]->error_message, "update for round 2 but round 1 is open");
  rig.Begin(selected[1], 1);
  EXPECT_FALSE(selected[1]->error);
  rig.Begin(selected[1], 1);
  EXPECT_EQ(selected[1]->error, v1::Error::DUPLICATE_UPDATE);
  // The sessions close once the error is written: nothing changes for the round.
  for (const auto& site : {unselected[0], selected[0], selected[1]}) {
    EXPECT_TRUE(site->closing());
    site->Close();
  }
  EXPECT_EQ(RoundOf(rig, 1).state, RoundState::kCollecting);

  rig.Upload(selected[2], 1, Filled(rig, 1.0f));
  EXPECT_FALSE(selected[2]->error);
  rig.executors.RunUntilIdle();
  const RoundRecord round = RoundOf(rig, 1);
  EXPECT_EQ(round.state, RoundState::kCommitted);
  EXPECT_EQ(round.updates_received, 1u);
  EXPECT_EQ(round.global_checksum, Checksum(Plus(rig.initial(), 1.0)));
  auto participations = ParticipationsOf(rig, 1);
  EXPECT_EQ(participations[selected[0]->name()].status, "rejected");
  EXPECT_EQ(participations[selected[1]->name()].status, "rejected");
  EXPECT_EQ(participations[selected[2]->name()].status, "committed");
  EXPECT_FALSE(participations.contains(unselected[0]->name()));
  const auto rejected = EventDetails(rig, "update_rejected");
  ASSERT_EQ(rejected.size(), 3u);
  EXPECT_EQ(rejected[0].rfind("NOT_SELECTED: ", 0), 0u) << rejected[0];
  EXPECT_EQ(rejected[1].rfind("ROUND_NOT_OPEN: ", 0), 0u) << rejected[1];
  EXPECT_EQ(rejected[2].rfind("DUPLICATE_UPDATE: second update from", 0), 0u) << rejected[2];
}

TEST(Coordinator, ASiteThatDropsMidUploadNeverReachesTheAggregate) {
  CoordinatorRig rig;
  rig.config.staging_slots = 1;
  ASSERT_TRUE(rig.Start().ok());
  auto a = rig.Connect("site-a");
  auto b = rig.Connect("site-b");
  rig.FinishDownloads({a, b});
  rig.Begin(b, 1);
  rig.SendChunks(b, 1, Filled(rig, 100.0f), 3);
  rig.Begin(a, 1);
  EXPECT_TRUE(a->paused) << "site-b holds the only slot";
  b->Close();
  EXPECT_FALSE(a->paused) << "site-b's slot went to site-a";
  const Participation dropped = ParticipationsOf(rig, 1)["site-b"];
  EXPECT_EQ(dropped.status, "dropped");
  // The round log tells a partial upload from none: three chunks of the model's bytes had arrived.
  EXPECT_EQ(dropped.detail, fmt::format("{}: {} of {} bytes received, discarded", kLostMidUpload, 3 * 65536,
                                        rig.manifest().byte_size()));
  ASSERT_EQ(rig.coordinator->Connected().size(), 1u);

  rig.SendChunks(a, 1, Filled(rig, 1.0f));
  rig.Commit(a, 1, Filled(rig, 1.0f));
  rig.executors.RunUntilIdle();
  const RoundRecord round = RoundOf(rig, 1);
  EXPECT_EQ(round.state, RoundState::kCommitted);
  EXPECT_EQ(round.updates_received, 1u);
  EXPECT_EQ(round.global_checksum, Checksum(Plus(rig.initial(), 1.0))) << "nothing of site-b's 100s";
}

TEST(Coordinator, UploadersBeyondTheStagingSlotsArePausedAndResumedInTheirOrder) {
  CoordinatorRig rig;
  rig.config.staging_slots = 1;
  rig.config.min_clients = 3;
  rig.config.clients_per_round = 3;
  ASSERT_TRUE(rig.Start().ok());
  auto a = rig.Connect("site-a");
  auto b = rig.Connect("site-b");
  auto c = rig.Connect("site-c");
  rig.FinishDownloads({a, b, c});
  const auto delta = Filled(rig, 1.0f);
  rig.Begin(a, 1);
  rig.Begin(c, 1);
  rig.Begin(b, 1);
  EXPECT_FALSE(a->paused);
  EXPECT_TRUE(c->paused);
  EXPECT_TRUE(b->paused);

  rig.SendChunks(a, 1, delta);
  rig.Commit(a, 1, delta);
  EXPECT_TRUE(c->paused) << "the slot is held until site-a's fold is done";
  rig.executors.RunUntilIdle();
  EXPECT_FALSE(c->paused) << "site-c began before site-b";
  EXPECT_EQ(c->resumed, 1);
  EXPECT_TRUE(b->paused);

  rig.SendChunks(c, 1, delta);
  rig.Commit(c, 1, delta);
  rig.executors.RunUntilIdle();
  EXPECT_FALSE(b->paused);
  rig.SendChunks(b, 1, delta);
  rig.Commit(b, 1, delta);
  rig.executors.RunUntilIdle();
  const RoundRecord round = RoundOf(rig, 1);
  EXPECT_EQ(round.state, RoundState::kCommitted);
  EXPECT_EQ(round.updates_received, 3u);
}

}  // namespace
}  // namespace estuary::server
