#include "server/late_sites.h"

#include <gtest/gtest.h>

#include "tests/server/fakes.h"

namespace estuary::server {
namespace {

using std::chrono::milliseconds;

TEST(LateSites, DoneOnceEverySiteOfTheRoundLogHasBeenTold) {
  fake::FakeClock clock;
  LateSites late;
  int done = 0;
  late.Start({"site-a", "site-b"}, clock, milliseconds(60'000), [&] { ++done; });
  EXPECT_TRUE(late.waiting());
  late.Told("site-a");
  late.Told("site-a");  // told twice (it reconnected): still one owed
  late.Told("site-z");  // not in the log: owes nothing
  EXPECT_EQ(done, 0);
  late.Told("site-b");
  EXPECT_EQ(done, 1);
  EXPECT_FALSE(late.waiting());
  EXPECT_EQ(clock.armed(), 0u) << "the limit's timer is cancelled";
  late.Told("site-b");
  clock.Advance(std::chrono::seconds(120));
  EXPECT_EQ(done, 1);
}

TEST(LateSites, ASiteGoneForGoodHoldsItOnlyUntilTheLimit) {
  fake::FakeClock clock;
  LateSites late;
  int done = 0;
  late.Start({"site-a", "site-b"}, clock, milliseconds(60'000), [&] { ++done; });
  late.Told("site-a");
  clock.Advance(milliseconds(59'999));
  EXPECT_EQ(done, 0);
  clock.Advance(milliseconds(1));
  EXPECT_EQ(done, 1);
  late.Told("site-b");
  EXPECT_EQ(done, 1);
}

TEST(LateSites, NoSitesInTheLogMeansDoneAtOnce) {
  fake::FakeClock clock;
  LateSites late;
  int done = 0;
  late.Start({}, clock, milliseconds(60'000), [&] { ++done; });
  EXPECT_EQ(done, 1);
  EXPECT_EQ(clock.armed(), 0u);
}

// The round log's clients table is what a restarted server owes.
TEST(LateSites, TheOwedSitesAreTheRoundLogsClients) {
  ::estuary::testing::TempDir dir;
  auto store = Store::Open(dir / "rounds.db");
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  ASSERT_TRUE((*store)->ClientSeen("site-b", "127.0.0.1:1", 1).ok());
  ASSERT_TRUE((*store)->ClientSeen("site-a", "127.0.0.1:2", 2).ok());
  ASSERT_TRUE((*store)->ClientSeen("site-a", "127.0.0.1:3", 3).ok());
  EXPECT_EQ(SitesInRoundLog(**store), (std::set<std::string>{"site-a", "site-b"}));
}

}  // namespace
}  // namespace estuary::server
