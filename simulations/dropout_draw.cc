#include "simulations/dropout_draw.h"

#include <algorithm>
#include <random>

#include "base/seed.h"

namespace estuary::simulations {

std::vector<int> DrawDropStages(double dropout, uint32_t sites, int stages, uint64_t seed, uint64_t round,
                                std::string_view purpose, bool keep_one) {
  std::mt19937_64 draws(MixSeed(MixSeed(seed, round), purpose));
  std::vector<int> drop(sites, 0);
  for (uint32_t u = 0; u < sites; ++u) {
    const double p = double(draws() >> 11) * 0x1p-53;
    const uint64_t stage = UniformBelow(draws, uint64_t(stages));
    if (p < dropout) drop[u] = int(1 + stage);
  }
  if (keep_one && sites > 0 && std::find(drop.begin(), drop.end(), 0) == drop.end()) {
    drop[UniformBelow(draws, sites)] = 0;
  }
  return drop;
}

std::vector<SiteDropStage> DrawSiteDropouts(double dropout, uint32_t sites, uint64_t seed, uint64_t round) {
  const std::vector<int> stages = DrawDropStages(dropout, sites, kSiteDropStages, seed, round, "site dropout", true);
  std::vector<SiteDropStage> out;
  out.reserve(stages.size());
  for (int stage : stages) out.push_back(SiteDropStage(stage));
  return out;
}

std::vector<uint64_t> CountByStage(const std::vector<SiteDropStage>& drawn) {
  std::vector<uint64_t> counts(kSiteDropStages, 0);
  for (SiteDropStage d : drawn) {
    if (d != SiteDropStage::kNone) ++counts[int(d) - 1];
  }
  return counts;
}

}  // namespace estuary::simulations
