#include "simulations/site_draws.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_map>

#include "base/seed.h"

namespace estuary::simulations {
namespace {

// `k` distinct values below `m`, uniformly, in O(k): a partial Fisher-Yates
// over the implicit array 0 .. m-1, its swapped positions in a map.
std::vector<uint32_t> DistinctBelow(DeterministicRandom& rng, uint32_t m, uint32_t k) {
  std::unordered_map<uint32_t, uint32_t> moved;
  moved.reserve(2 * size_t(k));
  auto at = [&](uint32_t position) {
    const auto it = moved.find(position);
    return it == moved.end() ? position : it->second;
  };
  std::vector<uint32_t> chosen(k);
  for (uint32_t i = 0; i < k; ++i) {
    const uint32_t j = i + uint32_t(rng.UniformInt(m - i));
    const uint32_t here = at(i);
    chosen[i] = at(j);
    moved[j] = here;
  }
  return chosen;
}

}  // namespace

Result<SiteExamples> SiteExamples::Create(const std::vector<int32_t>& labels, int num_classes,
                                          const PartitionSpec& spec, uint32_t examples_per_site, uint64_t seed) {
  const uint64_t n = labels.size();
  const std::string name = PartitionName(spec);
  if (examples_per_site == 0) return InvalidArgument("sim: --examples-per-client must be >= 1");
  if (examples_per_site > n) {
    return InvalidArgument("sim: --examples-per-client {}: the training set has only {} examples", examples_per_site, n);
  }
  if (num_classes <= 0) return InvalidArgument("sim: the training set has no classes");
  for (uint64_t i = 0; i < n; ++i) {
    if (labels[i] < 0 || labels[i] >= num_classes) {
      return InvalidArgument("sim: label {} of example {} is outside [0, {})", labels[i], i, num_classes);
    }
  }
  SiteExamples e;
  e.spec_ = spec;
  e.k_ = examples_per_site;
  e.seed_ = MixSeed(seed, std::string_view("population"));
  e.examples_ = uint32_t(n);
  switch (spec.kind) {
    case PartitionSpec::kIid:
      break;
    case PartitionSpec::kShards: {
      const uint64_t per_site = uint64_t(spec.shards_per_client);
      e.shard_size_ = uint32_t((examples_per_site + per_site - 1) / per_site);
      e.shards_ = uint32_t(n / e.shard_size_);
      if (e.shards_ < per_site) {
        return InvalidArgument("sim: --examples-per-client {} with --partition {}: {} shards of {} from {} examples, "
                               "fewer than the {} a site holds",
                               examples_per_site, name, e.shards_, e.shard_size_, n, per_site);
      }
      e.by_label_.resize(n);
      std::iota(e.by_label_.begin(), e.by_label_.end(), 0u);
      std::stable_sort(e.by_label_.begin(), e.by_label_.end(),
                       [&](uint32_t a, uint32_t b) { return labels[a] < labels[b]; });
      break;
    }
    case PartitionSpec::kDirichlet: {
      e.by_class_.resize(num_classes);
      for (uint32_t i = 0; i < n; ++i) e.by_class_[labels[i]].push_back(i);
      size_t smallest = n;
      for (const auto& members : e.by_class_) smallest = std::min(smallest, members.size());
      if (examples_per_site > smallest) {
        return InvalidArgument("sim: --examples-per-client {} with --partition {}: a site of one class would need more "
                               "than the smallest class's {} examples",
                               examples_per_site, name, smallest);
      }
      break;
    }
  }
  return e;
}

std::vector<uint32_t> SiteExamples::Of(uint64_t site) const {
  DeterministicRandom rng(MixSeed(seed_, site));
  std::vector<uint32_t> indices;
  switch (spec_.kind) {
    case PartitionSpec::kIid:
      indices = DistinctBelow(rng, examples_, k_);
      break;
    case PartitionSpec::kShards: {
      for (uint32_t shard : DistinctBelow(rng, shards_, uint32_t(spec_.shards_per_client))) {
        const uint32_t begin = shard * shard_size_;
        const uint32_t take = std::min(shard_size_, k_ - uint32_t(indices.size()));
        indices.insert(indices.end(), by_label_.begin() + begin, by_label_.begin() + begin + take);
      }
      break;
    }
    case PartitionSpec::kDirichlet: {
      const int classes = int(by_class_.size());
      const std::vector<double> share = rng.Dirichlet(spec_.alpha, classes);
      std::vector<double> cumulative(classes);
      std::partial_sum(share.begin(), share.end(), cumulative.begin());
      std::vector<uint32_t> count(classes, 0);
      for (uint32_t i = 0; i < k_; ++i) {
        const double u = rng.Uniform01() * cumulative.back();
        // The first class whose cumulative share exceeds u; one of zero share is never chosen.
        const int c = int(std::upper_bound(cumulative.begin(), cumulative.end(), u) - cumulative.begin());
        ++count[std::min(c, classes - 1)];
      }
      for (int c = 0; c < classes; ++c) {
        const auto& members = by_class_[c];
        for (uint32_t j : DistinctBelow(rng, uint32_t(members.size()), count[c])) indices.push_back(members[j]);
      }
      break;
    }
  }
  std::sort(indices.begin(), indices.end());
  return indices;
}

SeededPermutation::SeededPermutation(uint64_t n, uint64_t seed) : n_(n) {
  while (half_bits_ < 32 && (uint64_t(1) << (2 * half_bits_)) < n) ++half_bits_;
  for (int r = 0; r < 4; ++r) keys_[r] = MixSeed(seed, uint64_t(r));
}

uint64_t SeededPermutation::Encrypt(uint64_t x) const {
  const uint64_t mask = (uint64_t(1) << half_bits_) - 1;
  uint64_t left = x >> half_bits_, right = x & mask;
  for (uint64_t key : keys_) {
    const uint64_t next = left ^ (SplitMix64(right ^ key) & mask);
    left = right;
    right = next;
  }
  return (left << half_bits_) | right;
}

uint64_t SeededPermutation::operator()(uint64_t i) const {
  if (n_ <= 1) return i;
  // Encrypt permutes [0, 4^half_bits); walking the values that land past n
  // on through it ends inside [0, n), and distinct starts end distinctly.
  uint64_t x = Encrypt(i);
  while (x >= n_) x = Encrypt(x);
  return x;
}

uint64_t ChosenSiteCount(uint64_t sites, double fraction) {
  return uint64_t(std::llround(std::clamp(fraction, 0.0, 1.0) * double(sites)));
}

bool IsChosenSite(uint64_t site, uint64_t sites, double fraction, uint64_t seed, std::string_view purpose) {
  const uint64_t count = ChosenSiteCount(sites, fraction);
  if (count == 0) return false;
  return SeededPermutation(sites, MixSeed(seed, purpose))(site) < count;
}

}  // namespace estuary::simulations
