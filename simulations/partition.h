// How a simulation splits the training set among its clients.
//
// Three schemes, named the way the federated-learning literature does:
//   "iid"            every client gets a uniformly random, equal-size piece;
//   "shards[:N]"     McMahan et al. 2017's pathological non-IID split: sort by
//                    label, cut into num_clients * N shards (default N = 2),
//                    hand each client N random shards, so it sees <= ~N labels;
//   "dirichlet:A"    Hsu et al. 2019: for each class draw client proportions
//                    from Dir(A) and split that class by them. Small A (0.1)
//                    gives very skewed clients, large A (100) nearly IID ones.
//
// A partition is a pure function of (labels, num_clients, spec, seed) and is
// meant to be bit-identical on every machine, so that two runs of a scenario
// train on the same clients. That is why the sampling below is our own:
// std::mt19937_64's output is fixed by the standard, but std::uniform_*,
// std::shuffle and std::gamma_distribution are implementation-defined.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/seed.h"
#include "base/status.h"

namespace estuary::simulations {

struct PartitionSpec {
  enum Kind { kIid, kShards, kDirichlet };
  Kind kind = kIid;
  double alpha = 0;            // concentration of Dir(alpha); kDirichlet only
  int shards_per_client = 2;   // kShards only
  // kDirichlet re-draws while some client would get fewer examples than this.
  int min_examples_per_client = 1;
};

// Parses "iid", "shards", "shards:N" (N >= 1) or "dirichlet:A" (A > 0, finite).
Result<PartitionSpec> ParsePartition(std::string_view text);
// The canonical text of `spec`, which ParsePartition reads back ("dirichlet:0.5").
std::string PartitionName(const PartitionSpec& spec);

// For each of `num_clients` clients, the indices into `labels` of its
// examples, sorted ascending. Every index is given to exactly one client.
// Labels must lie in [0, num_classes). Fails when the split is impossible:
// num_clients <= 0 or more clients than examples, fewer examples than shards,
// or a Dirichlet draw that keeps leaving a client under its minimum.
Result<std::vector<std::vector<uint32_t>>> Partition(const std::vector<int32_t>& labels,
                                                     int num_classes, int num_clients,
                                                     const PartitionSpec& spec, uint64_t seed);

// Seeded random numbers whose every draw is the same on every conforming
// implementation: only std::mt19937_64's raw output is used, and the
// transformations are written out here. (Gamma draws go through std::log,
// std::exp and std::sqrt; sqrt is exact under IEEE 754, and glibc's log/exp
// agree across x86-64 machines.) Public so runners can pick clients the same way.
class DeterministicRandom {
 public:
  explicit DeterministicRandom(uint64_t seed) : engine_(seed) {}

  uint64_t NextU64() { return engine_(); }
  // Uniform in [0, bound), without modulo bias; bound must be > 0.
  uint64_t UniformInt(uint64_t bound);
  // Uniform in [0, 1) with 53 random bits.
  double Uniform01();
  // Standard normal (Marsaglia's polar method).
  double StandardNormal();
  // The natural log of a Gamma(shape, 1) draw, shape > 0 (Marsaglia & Tsang
  // 2000, with the shape < 1 boost). Returned as a log because for small
  // shapes the draw itself can underflow to 0.
  double LogGamma(double shape);
  // Proportions ~ Dir(alpha, ..., alpha) over `k` categories; they sum to 1.
  std::vector<double> Dirichlet(double alpha, int k);

  // Fisher-Yates, back to front (base/seed.h, shared with the trainers).
  template <typename T>
  void Shuffle(std::vector<T>& items) {
    ::estuary::Shuffle(items, engine_);
  }

 private:
  std::mt19937_64 engine_;
};

}  // namespace estuary::simulations
