#include "secagg/neighbours.h"

#include <gtest/gtest.h>

#include <set>

#include "tests/secagg/test_util.h"

namespace estuary::secagg {
namespace {

using testing::CountingKey;

TEST(NeighbourGraph, DefaultDegreeGrowsAsLogN) {
  EXPECT_EQ(DefaultDegree(2), 1);
  EXPECT_EQ(DefaultDegree(10), 9);  // 2 · ceil(1.5 · 3.32) = 10 > 9: complete
  EXPECT_EQ(DefaultDegree(100), 20);
  EXPECT_EQ(DefaultDegree(1000), 30);
  EXPECT_EQ(DefaultDegree(10000), 40);
  EXPECT_EQ(DefaultThreshold(20), 11);
  EXPECT_EQ(DefaultThreshold(9), 5);
  EXPECT_EQ(DefaultThreshold(4), 3);
}

void ExpectRegularSymmetric(const NeighbourGraph& graph, int degree) {
  for (int site = 0; site < graph.sites(); ++site) {
    const auto& mine = graph.Neighbours(site);
    EXPECT_EQ(static_cast<int>(mine.size()), degree) << "site " << site;
    EXPECT_EQ(std::set<uint32_t>(mine.begin(), mine.end()).size(), mine.size());
    for (uint32_t other : mine) {
      EXPECT_NE(other, static_cast<uint32_t>(site));
      EXPECT_LT(other, static_cast<uint32_t>(graph.sites()));
      EXPECT_TRUE(graph.Adjacent(other, site)) << other << " - " << site;
    }
  }
}

TEST(NeighbourGraph, HararyGraphIsRegularSymmetricAndConnected) {
  for (auto [n, k] : {std::pair{10, 4}, std::pair{100, 20}, std::pair{1000, 30}, std::pair{41, 40}}) {
    auto graph = NeighbourGraph::Harary(n, k, CountingKey(1));
    ASSERT_TRUE(graph.ok()) << graph.status().ToString();
    ExpectRegularSymmetric(*graph, k);
    std::vector<bool> reached(n, false);
    std::vector<uint32_t> todo = {0};
    reached[0] = true;
    while (!todo.empty()) {
      const uint32_t at = todo.back();
      todo.pop_back();
      for (uint32_t next : graph->Neighbours(at)) {
        if (!reached[next]) reached[next] = true, todo.push_back(next);
      }
    }
    EXPECT_EQ(std::count(reached.begin(), reached.end(), true), n);
  }
}

TEST(NeighbourGraph, CompleteWhenDegreeIsNMinusOne) {
  auto graph = NeighbourGraph::Harary(10, 9, CountingKey(1));
  ASSERT_TRUE(graph.ok());
  ExpectRegularSymmetric(*graph, 9);
}

TEST(NeighbourGraph, TheRoundSeedFixesTheRelabelling) {
  auto a = NeighbourGraph::Harary(100, 6, CountingKey(1));
  auto b = NeighbourGraph::Harary(100, 6, CountingKey(1));
  auto c = NeighbourGraph::Harary(100, 6, CountingKey(2));
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  int same_as_b = 0, same_as_c = 0;
  for (uint32_t site = 0; site < 100; ++site) {
    same_as_b += a->Neighbours(site) == b->Neighbours(site);
    same_as_c += a->Neighbours(site) == c->Neighbours(site);
  }
  EXPECT_EQ(same_as_b, 100);
  EXPECT_LT(same_as_c, 5);
  // Relabelled: site 0 is not simply joined to 1, 2, 3, 97, 98, 99.
  EXPECT_NE(a->Neighbours(0), (std::vector<uint32_t>{1, 2, 3, 97, 98, 99}));
}

TEST(NeighbourGraph, BadShapesAreRefused) {
  for (auto [n, k] : {std::pair{1, 0}, std::pair{10, 3}, std::pair{10, 10}, std::pair{10, 0}, std::pair{10, 12}}) {
    auto graph = NeighbourGraph::Harary(n, k, CountingKey(1));
    ASSERT_FALSE(graph.ok()) << n << " " << k;
    EXPECT_EQ(graph.status().code(), Code::kInvalidArgument);
  }
}

// A setup names the graph every site builds: one too large for a site to hold
// is refused before anything is allocated (a complete graph of 2^24 sites
// would be 2^48 entries).
TEST(NeighbourGraph, AGraphLargerThanASiteShouldHoldIsRefused) {
  for (auto [n, k] : {std::pair{1 << 24, (1 << 24) - 1}, std::pair{1 << 20, 18}, std::pair{5000, 4999}}) {
    auto graph = NeighbourGraph::Harary(n, k, CountingKey(1));
    ASSERT_FALSE(graph.ok()) << n << " " << k;
    EXPECT_NE(graph.status().message().find("more than 2^24"), std::string::npos) << graph.status().message();
  }
  EXPECT_TRUE(NeighbourGraph::Harary(1 << 16, 16, CountingKey(1)).ok());
  for (auto [n, k] : {std::pair{1 << 20, 18}, std::pair{5000, 4999}}) {
    auto one = SiteNeighbours::Of(0, n, k, CountingKey(1));
    ASSERT_FALSE(one.ok()) << n << " " << k;
    EXPECT_NE(one.status().message().find("more than 2^24"), std::string::npos) << one.status().message();
  }
}

// What a site keeps is its row of the graph the server builds, for every
// site, sparse and complete, and changes with the seed as the graph does.
TEST(SiteNeighbours, EachSiteFindsItsRowOfTheServersGraph) {
  for (auto [n, k, seed] : {std::tuple{10, 4, 1}, std::tuple{10, 9, 1}, std::tuple{101, 14, 2}, std::tuple{1000, 30, 3}}) {
    auto graph = NeighbourGraph::Harary(n, k, CountingKey(seed));
    ASSERT_TRUE(graph.ok()) << graph.status().ToString();
    for (uint32_t site = 0; site < uint32_t(n); ++site) {
      auto mine = SiteNeighbours::Of(site, n, k, CountingKey(seed));
      ASSERT_TRUE(mine.ok()) << mine.status().ToString();
      ASSERT_EQ(mine->ids(), graph->Neighbours(site)) << "n " << n << " k " << k << " site " << site;
      for (uint32_t other = 0; other < uint32_t(n); ++other) {
        ASSERT_EQ(mine->Contains(other), graph->Adjacent(site, other)) << site << " " << other;
      }
    }
  }
  auto other_seed = SiteNeighbours::Of(0, 1000, 30, CountingKey(4));
  auto graph = NeighbourGraph::Harary(1000, 30, CountingKey(3));
  ASSERT_TRUE(other_seed.ok() && graph.ok());
  EXPECT_NE(other_seed->ids(), graph->Neighbours(0));
}

TEST(SiteNeighbours, ASiteOutsideTheGraphIsRefused) {
  auto outside = SiteNeighbours::Of(10, 10, 4, CountingKey(1));
  ASSERT_FALSE(outside.ok());
  EXPECT_NE(outside.status().message().find("site 10 is not among the graph's 10 sites"), std::string::npos)
      << outside.status().message();
  EXPECT_FALSE(SiteNeighbours::Of(0, 10, 3, CountingKey(1)).ok());
}

}  // namespace
}  // namespace estuary::secagg
