#include "simulations/poisson_sampling.h"

#include <algorithm>
#include <cmath>

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

uint32_t PoissonPlannedMaximum(uint32_t sites, double q) {
  const double expected = q * sites;
  const double most = std::ceil(expected + 6 * std::sqrt(expected * (1 - q))) + 1;
  return uint32_t(std::min(most, double(sites)));
}

}  // namespace estuary::simulations
