#include "aggregation/sampling.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <random>
#include <set>

namespace estuary::aggregation {
namespace {

std::vector<std::string> Names(size_t n) {
  std::vector<std::string> names;
  for (size_t i = 0; i < n; ++i) names.push_back("site-" + std::to_string(i));
  return names;
}

TEST(Sampling, DeterministicAndOrderIndependent) {
  std::vector<std::string> names = Names(50);
  const auto first = SampleClients(names, 8, 42, 3);
  EXPECT_EQ(SampleClients(names, 8, 42, 3), first);
  std::shuffle(names.begin(), names.end(), std::mt19937_64(1));
  EXPECT_EQ(SampleClients(names, 8, 42, 3), first);
}

TEST(Sampling, DistinctSortedSubset) {
  const std::vector<std::string> names = Names(40);
  const std::set<std::string> all(names.begin(), names.end());
  for (uint64_t round = 0; round < 50; ++round) {
    const auto chosen = SampleClients(names, 7, 11, round);
    ASSERT_EQ(chosen.size(), 7u);
    EXPECT_TRUE(std::is_sorted(chosen.begin(), chosen.end()));
    EXPECT_EQ(std::set<std::string>(chosen.begin(), chosen.end()).size(), 7u);
    for (const auto& name : chosen) EXPECT_TRUE(all.count(name)) << name;
  }
}

TEST(Sampling, RoundsAndSeedsDiffer) {
  const std::vector<std::string> names = Names(100);
  // Two equal 10-of-100 draws happen with probability 1/C(100,10) ~ 6e-14.
  std::set<std::vector<std::string>> seen;
  for (uint64_t round = 0; round < 20; ++round) seen.insert(SampleClients(names, 10, 7, round));
  EXPECT_EQ(seen.size(), 20u);
  EXPECT_NE(SampleClients(names, 10, 7, 0), SampleClients(names, 10, 8, 0));
}

TEST(Sampling, EdgeCases) {
  const std::vector<std::string> names = {"c", "a", "b"};
  EXPECT_EQ(SampleClients(names, 10, 1, 1), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_TRUE(SampleClients(names, 0, 1, 1).empty());
  EXPECT_TRUE(SampleClients({}, 3, 1, 1).empty());
  EXPECT_EQ(SampleClients({"x", "x", "y"}, 5, 1, 1), (std::vector<std::string>{"x", "y"}));
}

// Each of 10 clients should be picked in about 3/10 of rounds.
TEST(Sampling, RoughlyUniform) {
  const std::vector<std::string> names = Names(10);
  std::map<std::string, int> picks;
  const int rounds = 3000;
  for (int round = 0; round < rounds; ++round)
    for (const auto& name : SampleClients(names, 3, 2024, round)) ++picks[name];
  for (const auto& name : names) {
    // Mean 900, standard deviation ~25; 150 is six of them.
    EXPECT_NEAR(picks[name], 900, 150) << name;
  }
}

// Pins the exact draw so a change of algorithm (or of standard library) that
// would make servers disagree about who is sampled shows up here. The value
// was cross-checked with an independent Python implementation of mt19937_64 +
// splitmix64 + the rejection draw.
TEST(Sampling, PinnedDraw) {
  EXPECT_EQ(SampleClients(Names(20), 4, 42, 1), (std::vector<std::string>{"site-17", "site-18", "site-2", "site-9"}));
}

TEST(Sampling, MixSeedIsSplitMix64) {
  // splitmix64's first output from state 0, per the reference implementation.
  // MixSeed(0, 0) = splitmix64(0 ^ splitmix64(0)).
  EXPECT_EQ(MixSeed(0, uint64_t{0}), 0xa706dd2f4d197e6full);
  EXPECT_EQ(MixSeed(42, uint64_t{7}), 0x6eab8625df268fbcull);
  EXPECT_EQ(MixSeed(1, "site-a"), 0xdadaaca02f7a385aull);  // FNV-1a then splitmix
  EXPECT_NE(MixSeed(1, "site-a"), MixSeed(1, "site-b"));
}

TEST(Sampling, UniformBelowRejectsTheBiasedTail) {
  // 2^64 mod 3 == 1, so a raw 0 must be rejected and the next value used.
  std::vector<uint64_t> raw = {0, 5};
  size_t next = 0;
  auto generator = [&] { return raw[next++]; };
  EXPECT_EQ(UniformBelow(generator, 3), 2u);
  EXPECT_EQ(next, 2u);
  std::mt19937_64 rng(3);
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(UniformBelow(rng, 1), 0u);
  for (int i = 0; i < 1000; ++i) EXPECT_LT(UniformBelow(rng, 7), 7u);
}

// Over names that sort in index order, the index draw is the name draw, from
// a handful of clients (k = n, every one) to more than a draw's reservoir.
TEST(Sampling, IndicesAreTheClientsDrawOverNamesInIndexOrder) {
  for (const auto& [n, k] : std::vector<std::pair<size_t, size_t>>{{1, 1}, {7, 7}, {7, 3}, {1000, 100}, {5000, 4999}}) {
    std::vector<std::string> names;
    for (size_t i = 0; i < n; ++i) names.push_back(fmt::format("client-{:07}", i));
    for (uint64_t round : {1, 2, 9}) {
      const std::vector<std::string> by_name = SampleClients(names, k, 77, round);
      const std::vector<uint64_t> by_index = SampleIndices(n, k, 77, round);
      ASSERT_EQ(by_index.size(), by_name.size()) << n << " " << k;
      for (size_t i = 0; i < by_index.size(); ++i) {
        EXPECT_EQ(names[by_index[i]], by_name[i]) << "n " << n << " k " << k << " round " << round;
      }
    }
  }
  EXPECT_EQ(SampleIndices(3, 10, 1, 1), (std::vector<uint64_t>{0, 1, 2}));
  EXPECT_TRUE(SampleIndices(0, 5, 1, 1).empty());
}

// A million clients: k distinct indices below n, and another round another draw.
TEST(Sampling, IndicesFromAMillionAreDistinctAndInRange) {
  const auto first = SampleIndices(1'000'000, 100, 5, 1);
  ASSERT_EQ(first.size(), 100u);
  EXPECT_TRUE(std::adjacent_find(first.begin(), first.end(), std::greater_equal<>()) == first.end());
  EXPECT_LT(first.back(), 1'000'000u);
  EXPECT_NE(SampleIndices(1'000'000, 100, 5, 2), first);
  EXPECT_EQ(SampleIndices(1'000'000, 100, 5, 1), first);
}

TEST(Sampling, ClientsPerRound) {
  EXPECT_EQ(ClientsPerRound(5, 100), 5u);
  EXPECT_EQ(ClientsPerRound(1, 100), 1u);
  EXPECT_EQ(ClientsPerRound(2.7, 10), 2u);
  EXPECT_EQ(ClientsPerRound(200, 50), 50u);
  EXPECT_EQ(ClientsPerRound(0.1, 30), 3u);
  EXPECT_EQ(ClientsPerRound(0.7, 10), 7u);  // 0.7 * 10 == 7.000000000000001 in double
  EXPECT_EQ(ClientsPerRound(0.07, 100), 7u);
  EXPECT_EQ(ClientsPerRound(0.25, 10), 3u);  // rounds up
  EXPECT_EQ(ClientsPerRound(0.01, 10), 1u);  // at least one
  EXPECT_EQ(ClientsPerRound(0.999, 10), 10u);
  EXPECT_EQ(ClientsPerRound(0.5, 0), 0u);
  EXPECT_EQ(ClientsPerRound(3, 0), 0u);
  EXPECT_EQ(ClientsPerRound(0, 10), 0u);
  EXPECT_EQ(ClientsPerRound(-1, 10), 0u);
  EXPECT_EQ(ClientsPerRound(std::nan(""), 10), 0u);
}

// Poisson sampling (serve --sample-rate): over 4000 rounds of 50 sites at
// q = 0.2, each site joins Binomial(4000, 0.2) times, 800 ± 25.3 (one σ);
// every count within 6σ (all 50 inside has probability 1 − 1e-7), and the
// rounds' sizes vary as Binomial(50, 0.2): mean 10, variance 8 (fixed-size
// sampling would give variance 0). Both the seeded draw and the server's
// RAND_bytes draw.
void ExpectPoissonFrequencies(const std::function<std::vector<std::string>(uint64_t round)>& draw) {
  const std::vector<std::string> names = Names(50);
  const int rounds = 4000;
  const double q = 0.2, sigma = std::sqrt(rounds * q * (1 - q));
  std::map<std::string, int> joins;
  double sum = 0, squares = 0;
  for (int r = 1; r <= rounds; ++r) {
    const std::vector<std::string> joined = draw(uint64_t(r));
    EXPECT_TRUE(std::is_sorted(joined.begin(), joined.end()));
    for (const auto& name : joined) ++joins[name];
    sum += double(joined.size());
    squares += double(joined.size()) * double(joined.size());
  }
  ASSERT_EQ(joins.size(), names.size());  // nobody outside the names, everybody at least once
  for (const auto& [name, count] : joins) EXPECT_NEAR(count, rounds * q, 6 * sigma) << name;
  const double mean = sum / rounds, variance = squares / rounds - mean * mean;
  // The sample mean's σ is √(8/4000) = 0.045; the sample variance's about 8·√(2/4000) = 0.18.
  EXPECT_NEAR(mean, 50 * q, 6 * 0.045);
  EXPECT_NEAR(variance, 50 * q * (1 - q), 6 * 0.18);
}

TEST(Sampling, PoissonSeededJoinsEachSiteWithProbabilityQ) {
  ExpectPoissonFrequencies([](uint64_t round) { return PoissonSampleClients(Names(50), 0.2, 7, round); });
}

TEST(Sampling, PoissonUnpredictableJoinsEachSiteWithProbabilityQ) {
  ExpectPoissonFrequencies([](uint64_t) {
    auto joined = PoissonSampleClientsUnpredictably(Names(50), 0.2);
    EXPECT_TRUE(joined.ok());
    return joined.ok() ? *joined : std::vector<std::string>{};
  });
}

TEST(Sampling, PoissonSeededRepeatsAndASitesDrawIgnoresTheOthers) {
  const std::vector<std::string> names = Names(40);
  EXPECT_EQ(PoissonSampleClients(names, 0.5, 3, 9), PoissonSampleClients(names, 0.5, 3, 9));
  EXPECT_NE(PoissonSampleClients(names, 0.5, 3, 9), PoissonSampleClients(names, 0.5, 4, 9));
  EXPECT_NE(PoissonSampleClients(names, 0.5, 3, 9), PoissonSampleClients(names, 0.5, 3, 10));
  // Half the sites gone, or the rest in another order with a duplicate: the
  // remaining sites' draws are what they were.
  const std::vector<std::string> all = PoissonSampleClients(names, 0.5, 3, 9);
  std::vector<std::string> half(names.begin(), names.begin() + 20);
  std::reverse(half.begin(), half.end());
  half.push_back(half.front());
  std::vector<std::string> expected;
  for (const auto& name : all) {
    if (std::find(half.begin(), half.end(), name) != half.end()) expected.push_back(name);
  }
  EXPECT_EQ(PoissonSampleClients(half, 0.5, 3, 9), expected);
  EXPECT_TRUE(PoissonSampleClients(names, 0, 3, 9).empty());
  EXPECT_EQ(PoissonSampleClients(names, 1, 3, 9).size(), names.size());
}

TEST(Sampling, PoissonUnpredictableDrawsDifferEveryTime) {
  // Two draws of 64 sites at q = 0.5 agree with probability 2^-64.
  auto a = PoissonSampleClientsUnpredictably(Names(64), 0.5), b = PoissonSampleClientsUnpredictably(Names(64), 0.5);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
}

}  // namespace
}  // namespace estuary::aggregation
