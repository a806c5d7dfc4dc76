// Tests of simulations/partition: the three split schemes, their determinism,
// their error cases, and the sampling they are built on. Suites are named
// simulations_* because ctest -R matches GoogleTest names, not targets.
#include "simulations/partition.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>

namespace estuary::simulations {
namespace {

using ClientIndices = std::vector<std::vector<uint32_t>>;

constexpr int kClasses = 10;

// Labels with the class sizes of the 8,000-example training split that
// scripts/fetch-mnist writes (seed 2017), in a scrambled order as in the file.
std::vector<int32_t> MnistLikeLabels() {
  const int counts[kClasses] = {805, 913, 776, 825, 766, 696, 809, 858, 745, 807};
  std::vector<int32_t> labels;
  for (int k = 0; k < kClasses; ++k) labels.insert(labels.end(), counts[k], k);
  DeterministicRandom(99).Shuffle(labels);
  return labels;
}

// `per_class` examples of each class, scrambled.
std::vector<int32_t> BalancedLabels(int per_class) {
  std::vector<int32_t> labels;
  for (int k = 0; k < kClasses; ++k) labels.insert(labels.end(), per_class, k);
  DeterministicRandom(7).Shuffle(labels);
  return labels;
}

ClientIndices MustPartition(const std::vector<int32_t>& labels, int clients,
                            std::string_view scheme, uint64_t seed) {
  Result<PartitionSpec> spec = ParsePartition(scheme);
  EXPECT_TRUE(spec.ok()) << spec.status().ToString();
  Result<ClientIndices> parts = Partition(labels, kClasses, clients, *spec, seed);
  EXPECT_TRUE(parts.ok()) << scheme << ": " << parts.status().ToString();
  return parts.ok() ? *parts : ClientIndices();
}

int DistinctLabels(const std::vector<uint32_t>& indices, const std::vector<int32_t>& labels) {
  std::set<int32_t> seen;
  for (uint32_t i : indices) seen.insert(labels[i]);
  return int(seen.size());
}

// The share of a client's examples that carry its most common label: 1 for a
// one-label client, about 1/kClasses for a client with the global mix.
double MaxLabelFraction(const std::vector<uint32_t>& indices, const std::vector<int32_t>& labels) {
  std::vector<int> counts(kClasses);
  for (uint32_t i : indices) ++counts[labels[i]];
  return double(*std::max_element(counts.begin(), counts.end())) / double(indices.size());
}

double MeanMaxLabelFraction(const ClientIndices& clients, const std::vector<int32_t>& labels) {
  double total = 0;
  for (const auto& c : clients) total += MaxLabelFraction(c, labels);
  return total / double(clients.size());
}

double MeanDistinctLabels(const ClientIndices& clients, const std::vector<int32_t>& labels) {
  double total = 0;
  for (const auto& c : clients) total += DistinctLabels(c, labels);
  return total / double(clients.size());
}

// FNV-1a over every client's size and indices: a short name for a whole partition.
uint64_t Fingerprint(const ClientIndices& clients) {
  uint64_t hash = 0xcbf29ce484222325ull;
  auto mix = [&](uint64_t word) {
    for (int b = 0; b < 8; ++b) {
      hash ^= (word >> (8 * b)) & 0xff;
      hash *= 0x100000001b3ull;
    }
  };
  for (const auto& c : clients) {
    mix(c.size());
    for (uint32_t i : c) mix(i);
  }
  return hash;
}

const char* const kSchemes[] = {"iid", "shards", "shards:3", "dirichlet:0.1", "dirichlet:1",
                                "dirichlet:100"};

// ---- ParsePartition -------------------------------------------------------

TEST(simulations_parse_partition, ReadsEachScheme) {
  Result<PartitionSpec> iid = ParsePartition("iid");
  ASSERT_TRUE(iid.ok());
  EXPECT_EQ(iid->kind, PartitionSpec::kIid);

  Result<PartitionSpec> shards = ParsePartition("shards");
  ASSERT_TRUE(shards.ok());
  EXPECT_EQ(shards->kind, PartitionSpec::kShards);
  EXPECT_EQ(shards->shards_per_client, 2);

  Result<PartitionSpec> shards5 = ParsePartition("shards:5");
  ASSERT_TRUE(shards5.ok());
  EXPECT_EQ(shards5->shards_per_client, 5);

  Result<PartitionSpec> dirichlet = ParsePartition("dirichlet:0.5");
  ASSERT_TRUE(dirichlet.ok());
  EXPECT_EQ(dirichlet->kind, PartitionSpec::kDirichlet);
  EXPECT_DOUBLE_EQ(dirichlet->alpha, 0.5);

  Result<PartitionSpec> large = ParsePartition("dirichlet:1e2");
  ASSERT_TRUE(large.ok());
  EXPECT_DOUBLE_EQ(large->alpha, 100);
}

TEST(simulations_parse_partition, RejectsMalformedText) {
  for (const char* text : {"", "IID", "random", "iid:2", "shards:0", "shards:-2", "shards:two",
                           "shards:", "dirichlet", "dirichlet:", "dirichlet:-1", "dirichlet:0",
                           "dirichlet:x", "dirichlet:0.5x", "dirichlet: 0.5", "dirichlet:inf",
                           "dirichlet:nan", "dirichlet:1e999"}) {
    Result<PartitionSpec> spec = ParsePartition(text);
    ASSERT_FALSE(spec.ok()) << "accepted \"" << text << "\"";
    EXPECT_EQ(spec.status().code(), Code::kInvalidArgument) << text;
    // The message quotes the input so a user sees which flag was wrong.
    EXPECT_NE(spec.status().message().find(fmt::format("\"{}\"", text)), std::string::npos)
        << spec.status().message();
  }
}

TEST(simulations_parse_partition, NameReadsBack) {
  for (const char* text : {"iid", "shards", "shards:3", "dirichlet:0.5", "dirichlet:100",
                           "dirichlet:0.123456789"}) {
    Result<PartitionSpec> spec = ParsePartition(text);
    ASSERT_TRUE(spec.ok()) << text;
    EXPECT_EQ(PartitionName(*spec), text);
  }
}

// ---- Properties every scheme has -------------------------------------------

TEST(simulations_partition, EveryIndexGoesToExactlyOneClient) {
  const std::vector<int32_t> labels = MnistLikeLabels();
  for (const char* scheme : kSchemes) {
    ClientIndices clients = MustPartition(labels, 100, scheme, 2017);
    ASSERT_EQ(clients.size(), 100u) << scheme;
    std::vector<int> owners(labels.size());
    for (const auto& c : clients) {
      EXPECT_FALSE(c.empty()) << scheme;
      EXPECT_TRUE(std::is_sorted(c.begin(), c.end())) << scheme;
      for (uint32_t i : c) {
        ASSERT_LT(i, labels.size()) << scheme;
        ++owners[i];
      }
    }
    EXPECT_EQ(std::count(owners.begin(), owners.end(), 1), std::ptrdiff_t(labels.size()))
        << scheme << ": some index missing or given twice";
  }
}

TEST(simulations_partition, SameSeedSameSplitDifferentSeedDifferentSplit) {
  const std::vector<int32_t> labels = MnistLikeLabels();
  for (const char* scheme : kSchemes) {
    ClientIndices a = MustPartition(labels, 50, scheme, 1);
    ClientIndices b = MustPartition(labels, 50, scheme, 1);
    ClientIndices c = MustPartition(labels, 50, scheme, 2);
    EXPECT_EQ(a, b) << scheme;
    EXPECT_NE(a, c) << scheme;
  }
}

// Pins the exact output for one seed. The point of our own sampling is that
// these numbers are the same on every machine and compiler; a change here
// means scenarios no longer reproduce earlier runs, so it must be deliberate.
TEST(simulations_partition, OutputIsPinnedAcrossMachines) {
  const std::vector<int32_t> labels = MnistLikeLabels();
  EXPECT_EQ(Fingerprint(MustPartition(labels, 100, "iid", 2017)), 0xa8d2eb8bc9f8e481ull);
  EXPECT_EQ(Fingerprint(MustPartition(labels, 100, "shards", 2017)), 0xdcce564b59797a5dull);
  EXPECT_EQ(Fingerprint(MustPartition(labels, 100, "dirichlet:0.5", 2017)), 0xc4e55928b496585dull);
}

// ---- IID -------------------------------------------------------------------

TEST(simulations_partition_iid, SizesDifferByAtMostOne) {
  std::vector<int32_t> labels = BalancedLabels(100);
  labels.resize(1003);  // not a multiple of the client count
  for (int clients : {1, 7, 10, 1003}) {
    ClientIndices parts = MustPartition(labels, clients, "iid", 3);
    ASSERT_EQ(int(parts.size()), clients);
    size_t smallest = labels.size(), largest = 0;
    for (const auto& c : parts) {
      smallest = std::min(smallest, c.size());
      largest = std::max(largest, c.size());
    }
    EXPECT_LE(largest - smallest, 1u) << clients << " clients";
    EXPECT_EQ(smallest, labels.size() / clients);
  }
}

TEST(simulations_partition_iid, ClientsSeeNearlyEveryLabel) {
  const std::vector<int32_t> labels = MnistLikeLabels();
  ClientIndices clients = MustPartition(labels, 100, "iid", 2017);
  EXPECT_GT(MeanDistinctLabels(clients, labels), 9.5);
  EXPECT_LT(MeanMaxLabelFraction(clients, labels), 0.25);
}

// ---- Shards ----------------------------------------------------------------

TEST(simulations_partition_shards, AtMostTwoLabelsWhenShardsFitClasses) {
  // 2,000 examples, 50 clients x 2 shards = 100 shards of 20; each class of
  // 200 is exactly 10 shards, so no shard mixes two labels.
  const std::vector<int32_t> labels = BalancedLabels(200);
  ClientIndices clients = MustPartition(labels, 50, "shards", 11);
  int two_label_clients = 0;
  for (const auto& c : clients) {
    EXPECT_EQ(c.size(), 40u);
    const int distinct = DistinctLabels(c, labels);
    EXPECT_GE(distinct, 1);
    EXPECT_LE(distinct, 2);
    two_label_clients += distinct == 2;
  }
  // Random shard assignment gives most clients two different labels.
  EXPECT_GT(two_label_clients, 25);
}

TEST(simulations_partition_shards, MeasurablyNonIidOnMnistCounts) {
  // With MNIST's uneven class sizes a shard may straddle two classes, so a
  // client can see up to 2 labels per shard, but rarely does.
  const std::vector<int32_t> labels = MnistLikeLabels();
  ClientIndices shards = MustPartition(labels, 100, "shards", 2017);
  ClientIndices iid = MustPartition(labels, 100, "iid", 2017);
  for (const auto& c : shards) EXPECT_LE(DistinctLabels(c, labels), 4);
  EXPECT_LT(MeanDistinctLabels(shards, labels), 2.5);
  // Two shards of different labels give 0.5; IID clients sit near 0.16.
  EXPECT_GT(MeanMaxLabelFraction(shards, labels), 0.45);
  EXPECT_GT(MeanMaxLabelFraction(shards, labels), 2.5 * MeanMaxLabelFraction(iid, labels));
}

TEST(simulations_partition_shards, MoreShardsPerClientMeansMoreLabels) {
  const std::vector<int32_t> labels = MnistLikeLabels();
  EXPECT_LT(MeanDistinctLabels(MustPartition(labels, 100, "shards:1", 5), labels),
            MeanDistinctLabels(MustPartition(labels, 100, "shards:4", 5), labels));
}

// ---- Dirichlet ---------------------------------------------------------------

TEST(simulations_partition_dirichlet, SmallAlphaSkewsLabelsLargeAlphaDoesNot) {
  const std::vector<int32_t> labels = MnistLikeLabels();
  const double skewed = MeanMaxLabelFraction(MustPartition(labels, 100, "dirichlet:0.1", 2017),
                                             labels);
  const double middle = MeanMaxLabelFraction(MustPartition(labels, 100, "dirichlet:1", 2017),
                                             labels);
  const double even = MeanMaxLabelFraction(MustPartition(labels, 100, "dirichlet:100", 2017),
                                           labels);
  EXPECT_GT(skewed, middle);
  EXPECT_GT(middle, even);
  // Dir(0.1) clients are dominated by one label (0.64 at this seed); Dir(100)
  // clients look like the global mix, whose largest class is 913 / 8000 = 11%.
  EXPECT_GT(skewed, 0.5);
  EXPECT_LT(even, 0.2);
  EXPECT_GT(skewed, 3 * even);
}

TEST(simulations_partition_dirichlet, RespectsMinimumPerClient) {
  const std::vector<int32_t> labels = MnistLikeLabels();
  PartitionSpec spec{PartitionSpec::kDirichlet, 0.3};
  spec.min_examples_per_client = 20;
  Result<ClientIndices> clients = Partition(labels, kClasses, 100, spec, 4);
  ASSERT_TRUE(clients.ok()) << clients.status().ToString();
  for (const auto& c : *clients) EXPECT_GE(c.size(), 20u);
}

TEST(simulations_partition_dirichlet, FailsWhenNoDrawMeetsTheMinimum) {
  // 100 clients over 200 examples at alpha 0.001: nearly all of each class
  // lands on one client, so nearly every client stays empty in every draw.
  const std::vector<int32_t> labels = BalancedLabels(20);
  PartitionSpec spec{PartitionSpec::kDirichlet, 0.001};
  Result<ClientIndices> clients = Partition(labels, kClasses, 100, spec, 1);
  ASSERT_FALSE(clients.ok());
  EXPECT_EQ(clients.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(clients.status().message().find("larger alpha"), std::string::npos);
}

// ---- Errors ------------------------------------------------------------------

TEST(simulations_partition, RejectsImpossibleRequests) {
  const std::vector<int32_t> labels = BalancedLabels(10);  // 100 examples
  const PartitionSpec iid{PartitionSpec::kIid};
  EXPECT_EQ(Partition(labels, kClasses, 0, iid, 1).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(Partition(labels, kClasses, -3, iid, 1).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(Partition(labels, kClasses, 101, iid, 1).status().code(), Code::kInvalidArgument);
  EXPECT_TRUE(Partition(labels, kClasses, 100, iid, 1).ok());
  EXPECT_EQ(Partition({}, kClasses, 1, iid, 1).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(Partition(labels, 0, 1, iid, 1).status().code(), Code::kInvalidArgument);

  // Labels outside [0, num_classes).
  std::vector<int32_t> bad = labels;
  bad[17] = kClasses;
  Result<ClientIndices> out_of_range = Partition(bad, kClasses, 2, iid, 1);
  ASSERT_FALSE(out_of_range.ok());
  EXPECT_NE(out_of_range.status().message().find("example 17"), std::string::npos);
  bad[17] = -1;
  EXPECT_FALSE(Partition(bad, kClasses, 2, iid, 1).ok());

  // 60 clients x 2 shards is more shards than examples.
  const PartitionSpec shards{PartitionSpec::kShards};
  EXPECT_EQ(Partition(labels, kClasses, 60, shards, 1).status().code(), Code::kInvalidArgument);
  EXPECT_TRUE(Partition(labels, kClasses, 50, shards, 1).ok());

  // A Dirichlet spec built by hand with a bad alpha or an unreachable minimum.
  EXPECT_FALSE(Partition(labels, kClasses, 5, PartitionSpec{PartitionSpec::kDirichlet, 0}, 1).ok());
  PartitionSpec greedy{PartitionSpec::kDirichlet, 1.0};
  greedy.min_examples_per_client = 30;  // 5 x 30 > 100
  EXPECT_EQ(Partition(labels, kClasses, 5, greedy, 1).status().code(), Code::kInvalidArgument);
}

// ---- DeterministicRandom -------------------------------------------------------

TEST(simulations_deterministic_random, UniformIntCoversItsRangeEvenly) {
  DeterministicRandom rng(5);
  EXPECT_EQ(rng.UniformInt(1), 0u);
  constexpr int kBound = 7, kDraws = 70000;
  std::vector<int> counts(kBound);
  for (int i = 0; i < kDraws; ++i) {
    const uint64_t x = rng.UniformInt(kBound);
    ASSERT_LT(x, uint64_t(kBound));
    ++counts[x];
  }
  for (int c : counts) EXPECT_NEAR(c, kDraws / kBound, 400);  // sd ~ 93
}

TEST(simulations_deterministic_random, Uniform01AndNormalHaveTheRightMoments) {
  DeterministicRandom rng(6);
  constexpr int kDraws = 200000;
  double sum_u = 0, sum_n = 0, sum_n2 = 0;
  for (int i = 0; i < kDraws; ++i) {
    const double u = rng.Uniform01();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum_u += u;
    const double n = rng.StandardNormal();
    sum_n += n;
    sum_n2 += n * n;
  }
  EXPECT_NEAR(sum_u / kDraws, 0.5, 0.005);
  EXPECT_NEAR(sum_n / kDraws, 0.0, 0.01);
  EXPECT_NEAR(sum_n2 / kDraws, 1.0, 0.02);
}

TEST(simulations_deterministic_random, GammaHasMeanAndVarianceEqualToShape) {
  constexpr int kDraws = 200000;
  for (double shape : {0.1, 0.5, 1.0, 2.5, 10.0}) {
    DeterministicRandom rng(8);
    double sum = 0, sum2 = 0;
    for (int i = 0; i < kDraws; ++i) {
      const double x = std::exp(rng.LogGamma(shape));
      ASSERT_GE(x, 0.0);
      sum += x;
      sum2 += x * x;
    }
    const double mean = sum / kDraws;
    const double variance = sum2 / kDraws - mean * mean;
    EXPECT_NEAR(mean, shape, 0.03 * shape) << "shape " << shape;
    EXPECT_NEAR(variance, shape, 0.08 * shape) << "shape " << shape;
  }
}

TEST(simulations_deterministic_random, DirichletIsADistributionWithEqualMeans) {
  DeterministicRandom rng(9);
  constexpr int kK = 5, kDraws = 20000;
  std::vector<double> mean(kK);
  for (int i = 0; i < kDraws; ++i) {
    const std::vector<double> p = rng.Dirichlet(0.05, kK);  // tiny alpha: underflow-prone
    ASSERT_EQ(p.size(), size_t(kK));
    double total = 0;
    for (int k = 0; k < kK; ++k) {
      ASSERT_GE(p[k], 0.0);
      total += p[k];
      mean[k] += p[k] / kDraws;
    }
    ASSERT_NEAR(total, 1.0, 1e-12);
  }
  for (double m : mean) EXPECT_NEAR(m, 1.0 / kK, 0.01);  // sd of each mean ~ 0.0025
}

TEST(simulations_deterministic_random, ShuffleIsAPermutationAndSeeded) {
  std::vector<int> a(100), b;
  std::iota(a.begin(), a.end(), 0);
  b = a;
  DeterministicRandom(1).Shuffle(a);
  DeterministicRandom(1).Shuffle(b);
  EXPECT_EQ(a, b);
  std::vector<int> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 100; ++i) EXPECT_EQ(sorted[i], i);
  std::vector<int> c = sorted;
  DeterministicRandom(2).Shuffle(c);
  EXPECT_NE(a, c);
  EXPECT_NE(a, sorted);
}

}  // namespace
}  // namespace estuary::simulations
