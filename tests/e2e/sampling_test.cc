// End-to-end: Poisson sampling on the server (serve --sample-rate), the real
// estuary-server and estuary-client binaries as child processes over mutual
// TLS on 127.0.0.1.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "aggregation/sampling.h"
#include "privacy/accountant.h"
#include "server/store.h"
#include "tests/e2e/federation.h"
#include "tests/e2e/harness.h"

namespace estuary::testing {
namespace {

// Poisson sampling on the server (--sample-rate 0.75, seeded for the test):
// four sites, three rounds under central DP. Each round's sites are exactly
// the seeded draw (each site by itself joins with probability 0.75: here 3,
// 4 and 2 sites), the log's sampling rate is q = 0.75 whatever the round
// drew, and its ε is the accountant's at q = 0.75 (DP-FedAvg divides by
// q · --total-sites = 3 each round; tests/aggregation/dp_fedavg_test.cc).
TEST(PoissonSampling, PoissonSampledRoundsTakeTheDrawnSitesAndChargeEpsilonAtTheSampleRate) {
  constexpr double kQ = 0.75, kDelta = 1e-5;
  const std::vector<std::string> names = {"site-a", "site-b", "site-c", "site-d"};
  Federation f;
  for (const auto& s : names) f.Issue(s);
  const uint16_t port = f.StartServer(3, 4, {"--sample-rate", "0.75", "--sample-seed", "3", "--total-sites", "4",
                                             "--dp-noise-multiplier", "1", "--dp-clip", "1", "--dp-delta", "1e-5"});
  std::vector<std::unique_ptr<ChildProcess>> children;
  for (const auto& s : names) children.push_back(f.StartClient(s, port));
  for (auto& c : children) EXPECT_EQ(c->Wait(), 0);
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 3u);
  std::set<uint32_t> sizes;
  for (const auto& r : *rounds) {
    ASSERT_EQ(r.state, server::RoundState::kCommitted) << r.detail;
    const std::vector<std::string> drawn = aggregation::PoissonSampleClients(names, kQ, 3, r.round);
    EXPECT_EQ(r.clients_selected, drawn.size()) << r.round;
    std::vector<std::string> took;
    for (const auto& [name, p] : ParticipationsByName(*store, r.round)) took.push_back(name);
    EXPECT_EQ(took, drawn) << r.round;
    sizes.insert(r.clients_selected);
    ASSERT_TRUE(r.privacy.has_value());
    EXPECT_EQ(r.privacy->sampling_rate, kQ);
    auto expected = privacy::EpsilonAfterRounds(kQ, 1.0, int64_t(r.round), kDelta);
    ASSERT_TRUE(expected.ok());
    EXPECT_DOUBLE_EQ(r.privacy->epsilon, expected->epsilon) << r.round;
  }
  EXPECT_GT(sizes.size(), 1u) << "every round drew the same number of sites: not Poisson sampling";
}

}  // namespace
}  // namespace estuary::testing
