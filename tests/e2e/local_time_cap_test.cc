// End-to-end: the cap on local training time (--max-local-seconds) with the
// real server and sites on 127.0.0.1. A cap far below one step's time leaves
// each capped site one step a round; the site says so, FedNova takes the
// partial work, and the rounds commit.
#include <gtest/gtest.h>

#include <regex>

#include "tests/e2e/federation.h"
#include "tests/e2e/harness.h"

namespace estuary::testing {
namespace {

// The steps `site` reported for each round it trained, from its log.
std::map<uint64_t, uint64_t> StepsByRound(const Federation& f, const std::string& site) {
  std::map<uint64_t, uint64_t> steps;
  const std::string log = f.ClientLog(site);
  const std::regex line(site + R"(: round (\d+): (\d+) local steps)");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), line); it != std::sregex_iterator(); ++it) {
    steps[std::stoull((*it)[1])] = std::stoull((*it)[2]);
  }
  return steps;
}

TEST(LocalTimeCap, TheServersCapReachesEverySite) {
  Federation f;
  for (const char* name : {"site-a", "site-b"}) f.Issue(name);
  const uint16_t port = f.StartServer(2, 2, {"--max-local-seconds", "0.000001", "--strategy", "fednova"});
  ASSERT_NE(port, 0);
  auto a = f.StartClient("site-a", port);
  auto b = f.StartClient("site-b", port);
  EXPECT_EQ(a->Wait(), 0) << f.ClientLog("site-a");
  EXPECT_EQ(b->Wait(), 0) << f.ClientLog("site-b");
  EXPECT_EQ(f.WaitServer(), 0) << f.ServerLog();
  for (const char* name : {"site-a", "site-b"}) {
    EXPECT_EQ(StepsByRound(f, name), (std::map<uint64_t, uint64_t>{{1, 1}, {2, 1}})) << f.ClientLog(name);
  }
  EXPECT_TRUE(f.AwaitCommitted(2));
}

// No cap from the server; site-b sets its own: it alone does partial work.
TEST(LocalTimeCap, ASitesOwnCapLimitsThatSiteAlone) {
  Federation f;
  for (const char* name : {"site-a", "site-b"}) f.Issue(name);
  const uint16_t port = f.StartServer(1, 2, {"--strategy", "fednova"});
  ASSERT_NE(port, 0);
  auto a = f.StartClient("site-a", port);
  auto b = f.StartClient("site-b", port, {}, {"--max-local-seconds", "0.000001"});
  EXPECT_EQ(a->Wait(), 0) << f.ClientLog("site-a");
  EXPECT_EQ(b->Wait(), 0) << f.ClientLog("site-b");
  EXPECT_EQ(f.WaitServer(), 0) << f.ServerLog();
  EXPECT_EQ(StepsByRound(f, "site-b"), (std::map<uint64_t, uint64_t>{{1, 1}})) << f.ClientLog("site-b");
  const auto full = StepsByRound(f, "site-a");
  ASSERT_EQ(full.size(), 1u) << f.ClientLog("site-a");
  // 300 examples, 10 % held out, batches of 10, one epoch.
  EXPECT_EQ(full.at(1), 27u) << f.ClientLog("site-a");
  EXPECT_TRUE(f.AwaitCommitted(1));
}

}  // namespace
}  // namespace estuary::testing
