// The Coordinator under SCAFFOLD, with fake sites and the worker run by the
// test: c goes out with every training round after the model, each upload
// brings Δc_i after its delta through the same staging and checksum, the
// commit folds them into c (c += Σ Δc_i / N), and a restarted coordinator
// sends the c it checkpointed.
#include <gtest/gtest.h>

#include "crypto/sha256.h"
#include "crypto/transfer_digest.h"
#include "proto/wire.h"
#include "tests/server/fakes.h"

namespace estuary::server {
namespace {

using fake::CoordinatorRig;
using fake::FakeSession;

std::string Checksum(const std::vector<float>& values) {
  return crypto::Sha256Hex(values.data(), values.size() * sizeof(float));
}

std::string Digest(const std::vector<float>& values) {
  return crypto::TransferDigestHex(values.data(), values.size() * sizeof(float));
}

std::vector<v1::RoundStart> RoundStarts(const FakeSession& session) {
  std::vector<v1::RoundStart> starts;
  for (const auto& e : session.SentOf(v1::Envelope::kRoundStart)) starts.push_back(e.round_start());
  return starts;
}

// A SCAFFOLD site's upload: UpdateBegin with control_follows, then the delta
// and Δc_i as one stream of chunks, and the checksum over both.
void UploadWithControl(CoordinatorRig& rig, const std::shared_ptr<FakeSession>& session, uint64_t round,
                       const std::vector<float>& delta, const std::vector<float>& control_delta, uint64_t examples) {
  v1::Envelope begin;
  auto* b = begin.mutable_update_begin();
  b->set_round(round);
  b->set_kind(v1::UPDATE_FULL);
  b->set_num_examples(examples);
  b->set_train_loss(1.0);
  *b->mutable_manifest() = proto::ToProto(rig.manifest());
  b->set_control_follows(true);
  rig.coordinator->OnMessage(session, begin);
  std::vector<float> both = delta;
  both.insert(both.end(), control_delta.begin(), control_delta.end());
  rig.SendChunks(session, round, both);
  rig.Commit(session, round, both);
}

TEST(CoordinatorScaffold, CFollowsTheModelDeltaCFollowsTheDeltaAndTheCommitFoldsItIntoC) {
  CoordinatorRig rig;
  rig.config.federation.mutable_strategy()->set_name("scaffold");
  rig.config.federation.mutable_strategy()->set_total_sites(4);
  ASSERT_TRUE(rig.Start().ok());
  auto a = rig.Connect("site-a");
  auto b = rig.Connect("site-b");
  const uint64_t n = rig.manifest().total_elements;
  const uint64_t bytes = rig.manifest().byte_size();
  const std::vector<float> zero(n, 0.0f);
  for (const auto& site : {a, b}) {
    const auto starts = RoundStarts(*site);
    ASSERT_EQ(starts.size(), 1u);
    EXPECT_TRUE(starts[0].control_follows());
    EXPECT_EQ(starts[0].control_digest(), Digest(zero)) << "c starts at zero";
    ASSERT_EQ(site->models.size(), 1u);
    EXPECT_EQ(site->models[0].ranges, (std::vector<std::pair<uint64_t, uint64_t>>{{0, bytes}, {bytes, 2 * bytes}}));
    ASSERT_TRUE(site->models[0].tail);
    EXPECT_EQ(*site->models[0].tail, zero);
  }
  rig.FinishDownloads({a, b});

  std::vector<float> dc_a(n), dc_b(n);
  for (uint64_t i = 0; i < n; ++i) {
    dc_a[i] = float(int(i % 7) - 3) * 0.125f;
    dc_b[i] = 1.0f / float(i % 11 + 1);
  }
  UploadWithControl(rig, a, 1, std::vector<float>(n, 1.0f), dc_a, 10);
  UploadWithControl(rig, b, 1, std::vector<float>(n, 3.0f), dc_b, 30);
  rig.executors.RunUntilIdle();
  auto round = rig.store->GetRound(1);
  ASSERT_TRUE(round.ok() && round->has_value());
  EXPECT_EQ((*round)->state, RoundState::kCommitted);
  EXPECT_EQ((*round)->updates_received, 2u);
  EXPECT_EQ((*round)->bytes_up, 2 * 2 * bytes) << "each upload: the delta and Δc_i";
  EXPECT_EQ((*round)->bytes_down, 2 * 2 * bytes) << "each download: the model and c";
  std::vector<float> x(n), c(n);
  for (uint64_t i = 0; i < n; ++i) {
    x[i] = float(double(rig.initial()[i]) + (10.0 * 1 + 30.0 * 3) / 40);
    c[i] = float(0.0 + 0.25 * (double(dc_a[i]) + double(dc_b[i])));
  }
  EXPECT_EQ((*round)->global_checksum, Checksum(x));
  EXPECT_TRUE(std::filesystem::exists(rig.config.checkpoint_dir / "global-r00001.safetensors.strategy"));
  for (const auto& site : {a, b}) {
    const auto starts = RoundStarts(*site);
    ASSERT_EQ(starts.size(), 2u);
    EXPECT_EQ(starts[1].control_digest(), Digest(c));
    ASSERT_EQ(site->models.size(), 2u);
    ASSERT_TRUE(site->models[1].tail);
    EXPECT_EQ(*site->models[1].tail, c);
  }

  // Round 2: an upload without Δc is refused in one line, before a byte is staged.
  rig.FinishDownloads({a, b});
  rig.Begin(a, 2);
  ASSERT_TRUE(a->error.has_value());
  EXPECT_EQ(*a->error, v1::Error::BAD_MESSAGE);
  EXPECT_NE(a->error_message.find("carries no control delta: strategy scaffold"), std::string::npos)
      << a->error_message;

  // A restart sends the c it checkpointed after round 1.
  rig.coordinator.reset();
  ASSERT_TRUE(rig.Start().ok());
  auto d = rig.Connect("site-d");
  rig.Connect("site-e");
  const auto starts = RoundStarts(*d);
  ASSERT_EQ(starts.size(), 1u);
  EXPECT_EQ(starts[0].round(), 2u);
  EXPECT_EQ(starts[0].control_digest(), Digest(c));
  ASSERT_EQ(d->models.size(), 1u);
  ASSERT_TRUE(d->models[0].tail);
  EXPECT_EQ(*d->models[0].tail, c);
}

}  // namespace
}  // namespace estuary::server
