// Asynchronous rounds (FedBuff) on the server's round logic, with fake sites,
// fake time and the worker run by the test: what goes out, what each version
// folds and with which weight, and what the round log records.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "aggregation/sampling.h"
#include "base/seed.h"
#include "crypto/sha256.h"
#include "tests/server/fakes.h"

namespace estuary::server {
namespace {

using fake::CoordinatorRig;
using fake::FakeSession;
using Sessions = std::vector<std::shared_ptr<FakeSession>>;

std::string Checksum(const std::vector<float>& values) {
  return crypto::Sha256Hex(values.data(), values.size() * sizeof(float));
}

// FedBuff's step on deltas that are the same everywhere: global + η/K Σ s_i d_i, in double.
std::vector<float> Step(const std::vector<float>& global, const std::vector<std::pair<double, double>>& weighted,
                        size_t k) {
  double sum = 0;
  for (const auto& [weight, delta] : weighted) sum += weight * delta;
  std::vector<float> out(global.size());
  for (size_t i = 0; i < global.size(); ++i) out[i] = float(double(global[i]) + sum / double(k));
  return out;
}

std::vector<float> Filled(const CoordinatorRig& rig, float value) {
  return std::vector<float>(rig.manifest().total_elements, value);
}

std::vector<v1::RoundStart> Starts(const FakeSession& session) {
  std::vector<v1::RoundStart> starts;
  for (const auto& e : session.SentOf(v1::Envelope::kRoundStart)) starts.push_back(e.round_start());
  return starts;
}

std::vector<v1::UpdateAck> Acks(const FakeSession& session) {
  std::vector<v1::UpdateAck> acks;
  for (const auto& e : session.SentOf(v1::Envelope::kUpdateAck)) acks.push_back(e.update_ack());
  return acks;
}

std::vector<Arrival> ArrivalsOf(CoordinatorRig& rig, uint64_t round) {
  auto rows = rig.store->Arrivals(round);
  EXPECT_TRUE(rows.ok()) << rows.status().ToString();
  return rows.ok() ? *rows : std::vector<Arrival>{};
}

RoundRecord RoundOf(CoordinatorRig& rig, uint64_t round) {
  auto record = rig.store->GetRound(round);
  EXPECT_TRUE(record.ok() && record->has_value()) << "round " << round;
  return record.ok() && record->has_value() ? **record : RoundRecord{};
}

void Async(CoordinatorRig& rig, uint32_t buffer, const std::string& weight, int64_t max_staleness = -1) {
  rig.config.mode = "async";
  rig.config.async.buffer = buffer;
  rig.config.async.staleness_weight = weight;
  rig.config.async.max_staleness = max_staleness;
}

// The site's latest work, downloaded, trained and uploaded as `value` everywhere.
void Train(CoordinatorRig& rig, const std::shared_ptr<FakeSession>& site, float value) {
  rig.FinishDownloads({site});
  const v1::RoundStart start = Starts(*site).back();
  rig.trained_from = start.model_version();
  rig.Upload(site, start.round(), Filled(rig, value));
  rig.executors.RunUntilIdle();
}

TEST(AsyncCoordinator, EveryKArrivalsMakeAVersionWeightedByStaleness) {
  CoordinatorRig rig;
  Async(rig, 2, "poly:0.5");
  rig.config.min_clients = 3;
  ASSERT_TRUE(rig.Start().ok());
  auto a = rig.Connect("site-a");
  auto b = rig.Connect("site-b");
  EXPECT_TRUE(Starts(*a).empty()) << "two of three connected: no work yet";
  auto c = rig.Connect("site-c");
  for (const auto& site : {a, b, c}) {
    ASSERT_EQ(Starts(*site).size(), 1u) << site->name();
    const v1::RoundStart start = Starts(*site)[0];
    EXPECT_TRUE(start.asynchronous());
    EXPECT_EQ(start.round(), 1u);
    EXPECT_EQ(start.model_version(), 0u);
    EXPECT_EQ(start.model_checksum(), Checksum(rig.initial()));
  }
  Train(rig, a, 1.0f);
  EXPECT_EQ(rig.async->version(), 0u) << "one of K = 2";
  ASSERT_EQ(Starts(*a).size(), 2u) << "answered: given the newest model again";
  EXPECT_EQ(Starts(*a)[1].model_version(), 0u);
  Train(rig, b, 2.0f);
  ASSERT_EQ(rig.async->version(), 1u);
  const std::vector<float> v1 = Step(rig.initial(), {{1, 1}, {1, 2}}, 2);
  RoundRecord one = RoundOf(rig, 1);
  EXPECT_EQ(one.state, RoundState::kCommitted);
  EXPECT_EQ(one.model_version, 1u);
  EXPECT_EQ(one.updates_received, 2u);
  EXPECT_EQ(one.strategy, "fedbuff");
  EXPECT_EQ(one.global_checksum, Checksum(v1));

  // c trained from version 0 while version 1 was made: one version stale.
  Train(rig, c, 4.0f);
  EXPECT_EQ(rig.async->version(), 1u);
  ASSERT_EQ(Starts(*b).size(), 2u);
  EXPECT_EQ(Starts(*b)[1].model_version(), 1u);
  EXPECT_EQ(Starts(*b)[1].round(), 2u);
  Train(rig, b, -1.0f);
  ASSERT_EQ(rig.async->version(), 2u);
  const double stale_weight = std::pow(2.0, -0.5);
  EXPECT_EQ(RoundOf(rig, 2).global_checksum, Checksum(Step(v1, {{stale_weight, 4}, {1, -1}}, 2)));

  const auto first = ArrivalsOf(rig, 1);
  ASSERT_EQ(first.size(), 2u);
  EXPECT_EQ(first[0].client, "site-a");
  EXPECT_EQ(first[1].client, "site-b");
  for (const Arrival& arrival : first) {
    EXPECT_EQ(arrival.status, "folded");
    EXPECT_EQ(arrival.trained_from, 0u);
    EXPECT_EQ(arrival.staleness, 0u);
    EXPECT_EQ(arrival.weight, 1.0);
  }
  const auto second = ArrivalsOf(rig, 2);
  ASSERT_EQ(second.size(), 2u);
  EXPECT_EQ(second[0].client, "site-c");
  EXPECT_EQ(second[0].trained_from, 0u);
  EXPECT_EQ(second[0].staleness, 1u);
  EXPECT_EQ(second[0].weight, stale_weight);
  EXPECT_EQ(second[1].client, "site-b");
  EXPECT_EQ(second[1].trained_from, 1u);
  EXPECT_EQ(second[1].staleness, 0u);
  EXPECT_EQ(second[1].weight, 1.0);
  for (const auto& site : {a, b, c}) {
    for (const auto& ack : Acks(*site)) EXPECT_TRUE(ack.accepted()) << site->name() << ": " << ack.detail();
  }
}

TEST(AsyncCoordinator, AnUpdateStalerThanTheLimitIsRefusedRecordedAndTheSiteGetsTheNewestModel) {
  CoordinatorRig rig;
  Async(rig, 1, "hinge:1,0", 0);
  ASSERT_TRUE(rig.Start().ok());
  auto a = rig.Connect("site-a");
  auto b = rig.Connect("site-b");
  Train(rig, a, 1.0f);
  ASSERT_EQ(rig.async->version(), 1u);
  const std::string v1 = RoundOf(rig, 1).global_checksum;
  Train(rig, b, 100.0f);  // from version 0: one version stale, beyond 0
  EXPECT_EQ(rig.async->version(), 1u);
  ASSERT_EQ(Acks(*b).size(), 1u);
  EXPECT_FALSE(Acks(*b)[0].accepted());
  EXPECT_NE(Acks(*b)[0].detail().find("1 versions stale"), std::string::npos) << Acks(*b)[0].detail();
  EXPECT_FALSE(b->closing()) << "a stale update is answered, not punished";
  const auto arrivals = ArrivalsOf(rig, 2);
  ASSERT_EQ(arrivals.size(), 1u);
  EXPECT_EQ(arrivals[0].status, "stale");
  EXPECT_EQ(arrivals[0].staleness, 1u);
  EXPECT_EQ(arrivals[0].trained_from, 0u);
  EXPECT_EQ(arrivals[0].weight, 0.0);
  ASSERT_EQ(Starts(*b).size(), 2u);
  EXPECT_EQ(Starts(*b)[1].model_version(), 1u);
  EXPECT_EQ(Starts(*b)[1].model_checksum(), v1);
  // Trained from the newest model, it is fresh and folds.
  Train(rig, b, 1.0f);
  EXPECT_EQ(rig.async->version(), 2u);
  EXPECT_EQ(ArrivalsOf(rig, 2).back().status, "folded");
}

TEST(AsyncCoordinator, AtMostConcurrencySitesTrainDrawnWithTheSeed) {
  CoordinatorRig rig;
  Async(rig, 10, "constant");
  rig.config.async.concurrency = 2;
  rig.config.min_clients = 5;
  rig.config.federation.mutable_task()->set_seed(11);
  ASSERT_TRUE(rig.Start().ok());
  Sessions sites;
  std::vector<std::string> names;
  for (int i = 0; i < 5; ++i) {
    names.push_back("site-" + std::to_string(i));
    sites.push_back(rig.Connect(names.back()));
  }
  auto working = [&] {
    std::vector<std::string> out;
    for (const auto& site : sites) {
      if (!Starts(*site).empty()) out.push_back(site->name());
    }
    return out;
  };
  EXPECT_EQ(working(), aggregation::SampleClients(names, 2, MixSeed(11, 1), 1));
  EXPECT_EQ(rig.async->training(), 2u);
  // Each answered update frees one place, which is drawn again from the three idle and the one answered.
  for (int i = 0; i < 6; ++i) {
    std::shared_ptr<FakeSession> busy;
    for (const auto& site : sites) {
      if (!Starts(*site).empty() && Acks(*site).size() < Starts(*site).size()) busy = site;
    }
    ASSERT_TRUE(busy);
    Train(rig, busy, 0.5f);
    EXPECT_EQ(rig.async->training(), 2u);
    size_t outstanding = 0;
    for (const auto& site : sites) outstanding += Starts(*site).size() - Acks(*site).size();
    EXPECT_EQ(outstanding, 2u) << "after " << i + 1 << " updates";
  }
  // A site that sends nothing within the deadline frees its place too.
  rig.clock.Advance(std::chrono::seconds(61));
  EXPECT_EQ(rig.async->training(), 2u);
  auto events = rig.store->Events();
  ASSERT_TRUE(events.ok());
  size_t ended = 0;
  for (const auto& e : *events) ended += e.kind == "work_ended";
  EXPECT_EQ(ended, 2u);
}

TEST(AsyncCoordinator, RVersionsThenTheFederationCompletes) {
  CoordinatorRig rig;
  Async(rig, 1, "constant");
  rig.config.rounds = 2;
  ASSERT_TRUE(rig.Start().ok());
  bool completed = false;
  rig.async->set_on_complete([&] { completed = true; });
  auto a = rig.Connect("site-a");
  auto b = rig.Connect("site-b");
  Train(rig, a, 1.0f);
  EXPECT_FALSE(completed);
  Train(rig, b, 1.0f);  // one version stale, weight 1
  EXPECT_FALSE(completed) << "the sites are told first, and leave";
  EXPECT_TRUE(rig.async->complete());
  EXPECT_EQ(rig.async->version(), 2u);
  EXPECT_EQ(*rig.store->GetMeta("complete"), std::optional<std::string>("2"));
  EXPECT_FALSE(rig.store->GetRound(3)->has_value()) << "no third version is begun";
  for (const auto& site : {a, b}) {
    const auto closed = site->SentOf(v1::Envelope::kRoundClosed);
    ASSERT_EQ(closed.size(), 1u);
    EXPECT_TRUE(closed[0].round_closed().federation_complete());
    EXPECT_EQ(closed[0].round_closed().model_version(), 2u);
  }
  EXPECT_EQ(Starts(*a).size(), 2u) << "no work after the last version";
  EXPECT_EQ(Starts(*b).size(), 1u);
  // a's work from version 1 arrives after the end: answered, folded into nothing.
  Train(rig, a, 1.0f);
  EXPECT_EQ(rig.async->version(), 2u);
  EXPECT_FALSE(Acks(*a).back().accepted());
  a->Close();
  EXPECT_FALSE(completed);
  b->Close();
  EXPECT_TRUE(completed) << "the last site has left";
}

TEST(AsyncCoordinator, ASiteThatDoesNotLeaveHoldsTheEndOnlyUntilTheIdleTimeout) {
  CoordinatorRig rig;
  Async(rig, 1, "constant");
  rig.config.rounds = 1;
  ASSERT_TRUE(rig.Start().ok());
  bool completed = false;
  rig.async->set_on_complete([&] { completed = true; });
  auto a = rig.Connect("site-a");
  auto b = rig.Connect("site-b");
  Train(rig, a, 1.0f);
  ASSERT_TRUE(rig.async->complete());
  a->Close();
  rig.clock.Advance(std::chrono::seconds(59));
  EXPECT_FALSE(completed);
  rig.clock.Advance(std::chrono::seconds(2));
  EXPECT_TRUE(completed);
}

TEST(AsyncCoordinator, AnUploadMustSayTheVersionItWasGiven) {
  CoordinatorRig rig;
  Async(rig, 2, "constant");
  ASSERT_TRUE(rig.Start().ok());
  auto a = rig.Connect("site-a");
  auto b = rig.Connect("site-b");
  rig.FinishDownloads({a, b});
  rig.trained_from.reset();
  rig.Begin(a, 1);
  EXPECT_EQ(a->error, v1::Error::BAD_MESSAGE);
  EXPECT_NE(a->error_message.find("trained_from_version"), std::string::npos) << a->error_message;
  rig.trained_from = 5;
  rig.Begin(b, 1);
  EXPECT_EQ(b->error, v1::Error::BAD_MESSAGE);
  EXPECT_NE(b->error_message.find("given version 0"), std::string::npos) << b->error_message;
}

TEST(AsyncCoordinator, ARestartResumesAtTheLastVersionAndBuildsTheNextAfresh) {
  CoordinatorRig rig;
  Async(rig, 2, "constant");
  rig.config.rounds = 5;
  ASSERT_TRUE(rig.Start().ok());
  auto a = rig.Connect("site-a");
  auto b = rig.Connect("site-b");
  Train(rig, a, 1.0f);
  Train(rig, b, 3.0f);
  ASSERT_EQ(rig.async->version(), 1u);
  Train(rig, a, 5.0f);  // half of version 2's buffer
  ASSERT_EQ(ArrivalsOf(rig, 2).size(), 1u);
  const std::vector<float> v1 = Step(rig.initial(), {{1, 1}, {1, 3}}, 2);

  rig.async.reset();
  rig.store.reset();
  ASSERT_TRUE(rig.Start().ok());
  EXPECT_EQ(rig.async->version(), 1u);
  auto a2 = rig.Connect("site-a");
  auto b2 = rig.Connect("site-b");
  EXPECT_TRUE(ArrivalsOf(rig, 2).empty()) << "the buffer is not checkpointed: version 2 begins again";
  for (const auto& site : {a2, b2}) {
    ASSERT_EQ(Starts(*site).size(), 1u);
    EXPECT_EQ(Starts(*site)[0].model_version(), 1u);
    EXPECT_EQ(Starts(*site)[0].model_checksum(), Checksum(v1));
  }
  Train(rig, a2, 2.0f);
  Train(rig, b2, 2.0f);
  ASSERT_EQ(rig.async->version(), 2u);
  EXPECT_EQ(RoundOf(rig, 2).global_checksum, Checksum(Step(v1, {{1, 2}, {1, 2}}, 2)));
  EXPECT_EQ(ArrivalsOf(rig, 2).size(), 2u);

  // The same log in the other mode is refused, in one line naming the mode.
  rig.async.reset();
  rig.store.reset();
  rig.config.mode = "sync";
  const Status refused = rig.Start();
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("restart it with --mode async"), std::string::npos) << refused.ToString();
}

TEST(AsyncCoordinator, WhatCannotRunAsynchronouslyIsRefusedWithWhy) {
  auto refusal = [](auto edit) {
    CoordinatorRig rig;
    rig.config.mode = "async";
    edit(rig.config);
    Status s = rig.config.Finalize();
    return s.ok() ? std::string("ok") : s.message();
  };
  EXPECT_EQ(refusal([](ServerConfig&) {}), "ok");
  EXPECT_NE(refusal([](ServerConfig& c) { c.secagg.on = true; }).find("mode = async with secagg"), std::string::npos);
  EXPECT_NE(refusal([](ServerConfig& c) { c.evaluate_every = 1; }).find("mode = async with evaluate_every"),
            std::string::npos);
  EXPECT_NE(refusal([](ServerConfig& c) { c.federation.mutable_strategy()->set_name("median"); })
                .find("a robust rule needs a whole round's updates"),
            std::string::npos);
  EXPECT_NE(refusal([](ServerConfig& c) { c.federation.mutable_strategy()->set_name("fedadam"); })
                .find("cannot run asynchronous rounds"),
            std::string::npos);
  EXPECT_NE(refusal([](ServerConfig& c) { c.async.staleness_weight = "poly:-1"; }).find("staleness_weight"),
            std::string::npos);
  EXPECT_NE(refusal([](ServerConfig& c) { c.async.buffer = 0; }).find("buffer = 0"), std::string::npos);
  EXPECT_NE(refusal([](ServerConfig& c) { c.async.max_staleness = -2; }).find("max_staleness = -2"),
            std::string::npos);
}

}  // namespace
}  // namespace estuary::server
