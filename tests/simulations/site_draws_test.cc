// A population's per-site draws: each site's examples from its own seed, the
// seeded permutation that picks a share of the sites, and Poisson sampling by
// index — each a function of (seed, site) or (seed, round), never of the
// population's size.
#include "simulations/site_draws.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <numeric>
#include <set>

#include "simulations/poisson_sampling.h"

namespace estuary::simulations {
namespace {

// 10 classes of 100 examples each, interleaved: labels[i] = i mod 10.
std::vector<int32_t> Labels(uint32_t n = 1000) {
  std::vector<int32_t> labels(n);
  for (uint32_t i = 0; i < n; ++i) labels[i] = int32_t(i % 10);
  return labels;
}

SiteExamples Make(const std::string& partition, uint32_t k, uint64_t seed = 3) {
  auto spec = ParsePartition(partition);
  EXPECT_TRUE(spec.ok());
  auto made = SiteExamples::Create(Labels(), 10, *spec, k, seed);
  EXPECT_TRUE(made.ok()) << made.status().ToString();
  return std::move(made).value();
}

std::set<int32_t> ClassesOf(const std::vector<uint32_t>& indices) {
  std::set<int32_t> classes;
  for (uint32_t i : indices) classes.insert(int32_t(i % 10));
  return classes;
}

TEST(SiteExamples, EachSiteHoldsKDistinctExamplesFromItsOwnSeed) {
  for (const std::string partition : {"iid", "shards", "shards:3", "dirichlet:0.5"}) {
    const SiteExamples a = Make(partition, 40), b = Make(partition, 40), other_seed = Make(partition, 40, 4);
    for (uint64_t site : {uint64_t(0), uint64_t(7), uint64_t(999'999), uint64_t(4'000'000'000)}) {
      const std::vector<uint32_t> examples = a.Of(site);
      ASSERT_EQ(examples.size(), 40u) << partition << " site " << site;
      EXPECT_TRUE(std::adjacent_find(examples.begin(), examples.end(), std::greater_equal<>()) == examples.end())
          << partition << ": ascending and distinct";
      EXPECT_LT(examples.back(), 1000u);
      // A function of (seed, site): the same from another sampler, asked in another order.
      EXPECT_EQ(b.Of(site), examples) << partition;
      EXPECT_NE(other_seed.Of(site), examples) << partition;
      EXPECT_NE(a.Of(site + 1), examples) << partition;
    }
  }
}

TEST(SiteExamples, PartitionsShapeTheSitesLabels) {
  const SiteExamples iid = Make("iid", 100), shards = Make("shards", 100), peaked = Make("dirichlet:0.05", 100),
                     flat = Make("dirichlet:1000", 100);
  size_t iid_classes = 0, peaked_classes = 0, flat_classes = 0;
  std::set<uint32_t> covered;
  for (uint64_t site = 0; site < 50; ++site) {
    iid_classes += ClassesOf(iid.Of(site)).size();
    // Two shards of 50 consecutive label-sorted examples: one class each.
    EXPECT_LE(ClassesOf(shards.Of(site)).size(), 2u) << site;
    peaked_classes += ClassesOf(peaked.Of(site)).size();
    flat_classes += ClassesOf(flat.Of(site)).size();
    for (uint32_t i : iid.Of(site)) covered.insert(i);
  }
  // 100 draws miss one of ten classes of 100 with probability ~3e-4 a site.
  EXPECT_GE(iid_classes, 50u * 10 - 2);
  EXPECT_LT(peaked_classes, 50u * 3);
  EXPECT_GE(flat_classes, 50u * 10 - 2);
  // 50 sites x 100 of 1000: they overlap, and between them cover nearly all.
  EXPECT_GT(covered.size(), 950u);
  // Shards of ceil(100 / 3) = 34, less the surplus of the last: still 100.
  EXPECT_EQ(Make("shards:3", 100).Of(5).size(), 100u);
}

TEST(SiteExamples, ImpossibleDrawsNameTheProblem) {
  auto fails = [](const std::string& partition, uint32_t k) {
    auto made = SiteExamples::Create(Labels(), 10, *ParsePartition(partition), k, 1);
    EXPECT_FALSE(made.ok()) << partition << " " << k;
    return made.ok() ? std::string() : made.status().message();
  };
  EXPECT_NE(fails("iid", 0).find("--examples-per-client must be >= 1"), std::string::npos);
  EXPECT_NE(fails("iid", 1001).find("only 1000 examples"), std::string::npos);
  EXPECT_NE(fails("shards:3", 1000).find("2 shards of 334 from 1000 examples, fewer than the 3 a site holds"),
            std::string::npos);
  EXPECT_NE(fails("dirichlet:0.5", 101).find("smallest class's 100"), std::string::npos);
  EXPECT_TRUE(SiteExamples::Create(Labels(), 10, *ParsePartition("dirichlet:0.5"), 100, 1).ok());
}

TEST(SeededPermutation, IsABijectionOfEverySize) {
  for (uint64_t n : {1, 2, 3, 10, 255, 1000, 4097}) {
    const SeededPermutation p(n, 42);
    std::vector<bool> seen(n, false);
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t v = p(i);
      ASSERT_LT(v, n) << "n " << n;
      EXPECT_FALSE(seen[v]) << "n " << n << ": " << v << " twice";
      seen[v] = true;
    }
  }
  const SeededPermutation a(1000, 1), b(1000, 2);
  int same = 0;
  for (uint64_t i = 0; i < 1000; ++i) same += a(i) == b(i);
  EXPECT_LT(same, 20);  // another seed, another permutation (about one fixed point in common expected)
}

TEST(SeededPermutation, ChoosesExactlyTheShareOfTheSites) {
  uint64_t attackers = 0, both = 0;
  for (uint64_t site = 0; site < 10'000; ++site) {
    const bool a = IsChosenSite(site, 10'000, 0.1, 7, "attackers");
    attackers += a;
    both += a && IsChosenSite(site, 10'000, 0.1, 7, "stragglers");
  }
  EXPECT_EQ(attackers, 1000u);
  EXPECT_EQ(ChosenSiteCount(10'000, 0.1), 1000u);
  EXPECT_NEAR(double(both), 100, 40);  // independent purposes: 10 % of 10 %
  EXPECT_FALSE(IsChosenSite(3, 10, 0, 7, "attackers"));
  EXPECT_TRUE(IsChosenSite(3, 10, 1, 7, "attackers"));
}

TEST(PoissonSampleIndices, DrawsEachSiteWithProbabilityQInTimeOfTheSitesDrawn) {
  double total = 0;
  std::vector<int> hits(1000, 0);
  for (uint64_t round = 1; round <= 400; ++round) {
    const std::vector<uint64_t> joined = PoissonSampleIndices(1000, 0.05, 9, round);
    EXPECT_TRUE(std::adjacent_find(joined.begin(), joined.end(), std::greater_equal<>()) == joined.end());
    EXPECT_EQ(PoissonSampleIndices(1000, 0.05, 9, round), joined);
    for (uint64_t site : joined) ++hits.at(site);
    total += double(joined.size());
  }
  // Mean 50 a round (sd of the mean over 400 rounds ~0.35); first and last sites drawn as often as the rest.
  EXPECT_NEAR(total / 400, 50, 1.5);
  const int first_tenth = std::accumulate(hits.begin(), hits.begin() + 100, 0);
  const int last_tenth = std::accumulate(hits.end() - 100, hits.end(), 0);
  EXPECT_NEAR(first_tenth, 2000, 200);
  EXPECT_NEAR(last_tenth, 2000, 200);
  EXPECT_EQ(PoissonSampleIndices(5, 1, 9, 1), (std::vector<uint64_t>{0, 1, 2, 3, 4}));
  // 2^32 - 1 sites at q = 2.5e-8: ~107 drawn, without visiting the others.
  const auto start = std::chrono::steady_clock::now();
  const std::vector<uint64_t> huge = PoissonSampleIndices(4'294'967'295u, 2.5e-8, 9, 1);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 0.5);
  EXPECT_NEAR(double(huge.size()), 107, 50);
  EXPECT_LT(huge.back(), 4'294'967'295u);
}

}  // namespace
}  // namespace estuary::simulations
