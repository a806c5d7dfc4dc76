// End-to-end: a round's deadline with real processes on 127.0.0.1. A site
// held stopped (SIGSTOP, so its connection stays open and silent) past the
// deadline is marked late and the round commits with the others; with too
// few updates the round fails, is tried again, and commits once the site
// runs again.
#include <gtest/gtest.h>
#include <signal.h>

#include "tests/e2e/federation.h"
#include "tests/e2e/harness.h"

namespace estuary::testing {
namespace {

// Starts site-c alone (too few to open a round), stops it once the server
// has it, then starts site-a and site-b: the round opens with site-c
// selected and silent.
struct SilentSite {
  std::unique_ptr<ChildProcess> a, b, c;
};
SilentSite StartWithSiteCStopped(Federation& f, uint16_t port) {
  SilentSite s;
  s.c = f.StartClient("site-c", port);
  EXPECT_TRUE(f.AwaitLog("client site-c connected")) << f.ServerLog();
  EXPECT_EQ(kill(s.c->pid(), SIGSTOP), 0);
  s.a = f.StartClient("site-a", port);
  s.b = f.StartClient("site-b", port);
  return s;
}

TEST(Deadline, ASilentSiteIsMarkedLateAndTheRoundCommitsWithTheOthers) {
  Federation f;
  for (const char* name : {"site-a", "site-b", "site-c"}) f.Issue(name);
  const uint16_t port = f.StartServer(1, 3, {"--min-updates", "2", "--round-deadline", "5"});
  ASSERT_NE(port, 0);
  SilentSite sites = StartWithSiteCStopped(f, port);
  EXPECT_EQ(sites.a->Wait(), 0) << f.ClientLog("site-a");
  EXPECT_EQ(sites.b->Wait(), 0) << f.ClientLog("site-b");
  EXPECT_EQ(f.WaitServer(), 0) << f.ServerLog();
  kill(sites.c->pid(), SIGCONT);

  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto round = store->GetRound(1);
  ASSERT_TRUE(round.ok() && round->has_value());
  EXPECT_EQ((*round)->state, server::RoundState::kCommitted);
  EXPECT_EQ((*round)->clients_selected, 3u);
  EXPECT_EQ((*round)->updates_received, 2u);
  const auto by_name = ParticipationsByName(*store, 1);
  ASSERT_EQ(by_name.count("site-c"), 1u);
  EXPECT_EQ(by_name.at("site-c").status, "late");
  EXPECT_EQ(by_name.at("site-c").detail, "no update before the deadline");
  for (const char* name : {"site-a", "site-b"}) EXPECT_NE(by_name.at(name).status, "late") << name;
  EXPECT_NE(f.ServerLog().find("round 1 deadline: 2 updates received"), std::string::npos) << f.ServerLog();
}

TEST(Deadline, ARoundShortOfItsUpdatesFailsIsTriedAgainAndCommits) {
  Federation f;
  for (const char* name : {"site-a", "site-b", "site-c"}) f.Issue(name);
  const uint16_t port = f.StartServer(1, 3, {"--min-updates", "3", "--round-deadline", "5"});
  ASSERT_NE(port, 0);
  SilentSite sites = StartWithSiteCStopped(f, port);
  ASSERT_TRUE(f.AwaitLog("round 1 failed: 2 of 3 updates received, 3 needed")) << f.ServerLog();
  EXPECT_EQ(kill(sites.c->pid(), SIGCONT), 0);
  EXPECT_TRUE(f.AwaitCommitted(1)) << f.ServerLog();
  EXPECT_EQ(sites.a->Wait(), 0) << f.ClientLog("site-a");
  EXPECT_EQ(sites.b->Wait(), 0) << f.ClientLog("site-b");
  EXPECT_EQ(sites.c->Wait(), 0) << f.ClientLog("site-c");
  EXPECT_EQ(f.WaitServer(), 0) << f.ServerLog();

  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto round = store->GetRound(1);
  ASSERT_TRUE(round.ok() && round->has_value());
  EXPECT_EQ((*round)->state, server::RoundState::kCommitted);
  EXPECT_EQ((*round)->updates_received, 3u);
  EXPECT_EQ(store->CountEvents("round_failed", "round 1 try 1: 2 of 3 updates received, 3 needed").value(), 1u);
  EXPECT_NE(f.ServerLog().find("round 1 open (try 2)"), std::string::npos) << f.ServerLog();
}

}  // namespace
}  // namespace estuary::testing
