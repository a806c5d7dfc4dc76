// StagingSlots: at most K uploads staged, the rest paused and granted slots
// in the order they began.
#include <gtest/gtest.h>

#include <filesystem>

#include "server/staging_slots.h"
#include "tests/server/fakes.h"

namespace estuary::server {
namespace {

using fake::FakeSession;

Manifest Flat(uint64_t n) {
  Manifest m;
  m.tensors.push_back({"w", {int64_t(n)}, DType::kF32, 0});
  m.total_elements = n;
  return m;
}

class StagingSlotsTest : public ::testing::Test {
 protected:
  std::shared_ptr<FakeSession> Begin(const std::string& name) {
    auto session = std::make_shared<FakeSession>(name);
    EXPECT_TRUE(slots.Begin(session, Flat(16)).ok());
    return session;
  }
  void ExpectNoneRefused() { EXPECT_TRUE(slots.Grant().empty()); }

  StagingSlots slots{2, 1 << 20, std::filesystem::temp_directory_path()};
};

TEST_F(StagingSlotsTest, TheUploadsBeyondKArePausedAndGrantedInOrder) {
  auto a = Begin("a"), b = Begin("b"), c = Begin("c"), d = Begin("d");
  EXPECT_NE(slots.Staged("a"), nullptr);
  EXPECT_NE(slots.Staged("b"), nullptr);
  EXPECT_FALSE(a->paused || b->paused);
  EXPECT_EQ(slots.Staged("c"), nullptr);
  EXPECT_TRUE(c->paused && slots.Queued("c"));
  EXPECT_TRUE(d->paused && slots.Queued("d"));
  EXPECT_EQ(slots.in_use(), 2u);

  slots.Release("a");  // rejected, dropped or late
  ExpectNoneRefused();
  EXPECT_FALSE(c->paused);
  EXPECT_NE(slots.Staged("c"), nullptr);
  EXPECT_FALSE(slots.Queued("c"));
  EXPECT_TRUE(d->paused);

  // A committed upload keeps its slot while it folds.
  ASSERT_NE(slots.TakeForFold("b"), nullptr);
  EXPECT_EQ(slots.Staged("b"), nullptr);
  ExpectNoneRefused();
  EXPECT_TRUE(d->paused);
  slots.FoldDone();
  ExpectNoneRefused();
  EXPECT_FALSE(d->paused);
  EXPECT_EQ(d->resumed, 1);
  EXPECT_EQ(slots.in_use(), 2u);
}

TEST_F(StagingSlotsTest, AReleasedOrClosedWaiterIsNeverGranted) {
  auto a = Begin("a"), b = Begin("b"), c = Begin("c"), d = Begin("d"), e = Begin("e");
  slots.Release("c");  // left the queue
  d->Close();          // gone while it waited
  slots.Release("a");
  ExpectNoneRefused();
  EXPECT_EQ(c->resumed, 0);
  EXPECT_EQ(d->resumed, 0);
  EXPECT_EQ(e->resumed, 1);
  EXPECT_NE(slots.Staged("e"), nullptr);
}

TEST_F(StagingSlotsTest, ANewRoundDropsTheQueueButNotTheFoldsSlots) {
  auto a = Begin("a"), b = Begin("b"), c = Begin("c");
  ASSERT_NE(slots.TakeForFold("a"), nullptr);
  slots.Reset();
  EXPECT_EQ(slots.in_use(), 1u) << "a's fold still runs";
  EXPECT_FALSE(slots.Queued("c"));
  EXPECT_EQ(slots.Staged("b"), nullptr);
  auto d = Begin("d");
  auto e = Begin("e");
  EXPECT_FALSE(d->paused);
  EXPECT_TRUE(e->paused);
  slots.FoldDone();
  ExpectNoneRefused();
  EXPECT_FALSE(e->paused);
  EXPECT_EQ(c->resumed, 0);
}

TEST_F(StagingSlotsTest, AnUploadThatCannotBeStagedHoldsNoSlot) {
  StagingSlots spilling(1, 0, "/nonexistent/estuary-spill");
  auto a = std::make_shared<FakeSession>("a");
  const Status begun = spilling.Begin(a, Flat(16));
  EXPECT_FALSE(begun.ok());
  EXPECT_NE(begun.message().find("/nonexistent/estuary-spill"), std::string::npos) << begun.message();
  EXPECT_EQ(spilling.in_use(), 0u);
}

}  // namespace
}  // namespace estuary::server
