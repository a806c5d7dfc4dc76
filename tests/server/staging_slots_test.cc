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

// A secure-aggregation input's undo copy takes the same slots as uploads:
// beyond K it waits, paused, and is granted in order; it lives in memory up to
// the budget and in a spill file beyond it.
TEST_F(StagingSlotsTest, SecAggCopiesShareTheSlotsWithUploads) {
  auto a = Begin("a");
  auto b = std::make_shared<FakeSession>("b"), c = std::make_shared<FakeSession>("c");
  ASSERT_TRUE(slots.BeginJournal(b, 4 * 1000).ok());
  ASSERT_TRUE(slots.BeginJournal(c, 4 * 1000).ok());
  ASSERT_NE(slots.Journal("b"), nullptr);
  EXPECT_EQ(slots.Journal("b")->size(), 4000u);
  EXPECT_FALSE(slots.Journal("b")->spilled());
  EXPECT_EQ(slots.Staged("b"), nullptr) << "a copy is not an upload";
  EXPECT_EQ(slots.Journal("c"), nullptr);
  EXPECT_TRUE(c->paused && slots.Queued("c"));
  EXPECT_EQ(slots.in_use(), 2u);
  slots.Release("b");  // its input complete, or withdrawn
  ExpectNoneRefused();
  EXPECT_FALSE(c->paused);
  ASSERT_NE(slots.Journal("c"), nullptr);
  const uint8_t seven = 7, eight = 8;
  ASSERT_TRUE(slots.Journal("c")->Write(3999, &seven, 1).ok()) << "all of it writable";
  uint8_t back = 0;
  ASSERT_TRUE(slots.Journal("c")->Read(3999, &back, 1).ok());
  EXPECT_EQ(back, 7);
  EXPECT_FALSE(slots.Journal("c")->Write(4000, &seven, 1).ok()) << "not beyond it";
  EXPECT_EQ(slots.Journal("b"), nullptr);

  StagingSlots small{1, 100, std::filesystem::temp_directory_path()};
  auto d = std::make_shared<FakeSession>("d");
  ASSERT_TRUE(small.BeginJournal(d, 4000).ok());
  ASSERT_NE(small.Journal("d"), nullptr);
  EXPECT_TRUE(small.Journal("d")->spilled()) << "beyond the memory budget: a spill file";
  ASSERT_TRUE(small.Journal("d")->Write(3999, &eight, 1).ok());
  ASSERT_TRUE(small.Journal("d")->Read(3999, &back, 1).ok());
  EXPECT_EQ(back, 8) << "read back from the spill file";
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
