// What a site of a large simulated population is, drawn from its own seed:
// its examples (estuary-sim --examples-per-client K) and whether it is one of
// a fixed share of the sites (attackers, stragglers). Each draw costs O(K) or
// O(1) for the one site asked about and nothing for the others, so a
// population of millions is only as costly as the sites a round samples.
//
// Site s's examples come from mt19937_64(MixSeed(MixSeed(seed, "population"),
// s)) and the training set alone: a function of (seed, s), not of the
// population's size nor of the other sites. Sites overlap (two may hold the
// same example) and a site's K examples are distinct. Under each partition:
//   iid              K examples uniform over the training set.
//   shards[:S]       the training set sorted by label (stably) and cut into
//                    shards of ceil(K / S) consecutive examples; the site
//                    holds S distinct shards drawn uniformly, less its last
//                    shard's surplus when S does not divide K. McMahan's
//                    pathological split, the shards shared among sites.
//   dirichlet:ALPHA  the site draws class proportions p ~ Dir(ALPHA), then
//                    each example's class from p, then that many distinct
//                    examples of each class uniformly.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "simulations/partition.h"

namespace estuary::simulations {

class SiteExamples {
 public:
  // Fails in one line when K examples cannot be drawn as `spec` says: K is 0
  // or above the training set, fewer than S shards of ceil(K / S), or (dirichlet) K
  // above the smallest class, which a site of one class would exhaust.
  static Result<SiteExamples> Create(const std::vector<int32_t>& labels, int num_classes, const PartitionSpec& spec,
                                     uint32_t examples_per_site, uint64_t seed);

  // Site `site`'s K indices into the training set, ascending. O(K + classes).
  std::vector<uint32_t> Of(uint64_t site) const;

 private:
  PartitionSpec spec_;
  uint32_t k_ = 0;
  uint64_t seed_ = 0;
  uint32_t examples_ = 0;
  std::vector<uint32_t> by_label_;               // shards: indices sorted by label
  uint32_t shard_size_ = 0, shards_ = 0;
  std::vector<std::vector<uint32_t>> by_class_;  // dirichlet: each class's indices
};

// A bijection of [0, n) chosen by `seed`, evaluated in O(1) expected time
// with no table: a four-round Feistel network over the smallest even number of
// bits that holds n, walking values at or above n through it again (fewer
// than four steps on average). Portable: SplitMix64 only.
class SeededPermutation {
 public:
  SeededPermutation(uint64_t n, uint64_t seed);
  uint64_t operator()(uint64_t i) const;

 private:
  uint64_t Encrypt(uint64_t x) const;
  uint64_t n_;
  int half_bits_ = 1;
  uint64_t keys_[4];
};

// Whether `site` is one of llround(fraction · sites) sites chosen for
// `purpose` ("attackers", "stragglers"): those the seeded permutation puts
// first. The count is exact and each answer O(1), with no vector of sites.
bool IsChosenSite(uint64_t site, uint64_t sites, double fraction, uint64_t seed, std::string_view purpose);
uint64_t ChosenSiteCount(uint64_t sites, double fraction);

}  // namespace estuary::simulations
