#include "simulations/poisson_sampling.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "base/seed.h"

namespace estuary::simulations {

std::vector<std::string> PoissonSample(const std::vector<std::string>& names, double q, uint64_t seed, uint64_t round) {
  const uint64_t round_seed = MixSeed(MixSeed(seed, round), "poisson sampling");
  std::vector<std::string> joined;
  for (const std::string& name : names) {
    const double u = double(MixSeed(round_seed, name) >> 11) * 0x1p-53;
    if (u < q) joined.push_back(name);
  }
  std::sort(joined.begin(), joined.end());
  joined.erase(std::unique(joined.begin(), joined.end()), joined.end());
  return joined;
}

std::vector<uint64_t> PoissonSampleIndices(uint64_t n, double q, uint64_t seed, uint64_t round) {
  std::vector<uint64_t> joined;
  if (!(q > 0) || n == 0) return joined;
  if (q >= 1) {
    joined.resize(n);
    for (uint64_t i = 0; i < n; ++i) joined[i] = i;
    return joined;
  }
  std::mt19937_64 rng(MixSeed(MixSeed(MixSeed(seed, round), "poisson sampling"), "by index"));
  const double log_miss = std::log1p(-q);
  for (uint64_t next = 0;;) {
    // Trials before the next success ~ Geometric(q); 1 - U lies in (0, 1].
    const double u = 1 - double(rng() >> 11) * 0x1p-53;
    const double gap = std::floor(std::log(u) / log_miss);
    if (!(gap < double(n - next))) break;  // past the last site (or infinite)
    next += uint64_t(gap);
    joined.push_back(next++);
    if (next >= n) break;
  }
  return joined;
}

}  // namespace estuary::simulations
