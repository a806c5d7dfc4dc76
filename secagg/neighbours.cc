#include "secagg/neighbours.h"

#include <algorithm>
#include <cmath>

#include "secagg/prg.h"

namespace estuary::secagg {

int DefaultDegree(int sites) {
  if (sites <= 1) return 0;
  const int half = static_cast<int>(std::ceil(1.5 * std::log2(static_cast<double>(sites))));
  return std::min(sites - 1, 2 * half);
}

int DefaultThreshold(int degree) { return degree / 2 + 1; }

Result<NeighbourGraph> NeighbourGraph::Harary(int sites, int degree, const Key32& round_seed) {
  if (sites < 2) return InvalidArgument("secagg: neighbour graph over {} sites: need at least 2", sites);
  const bool complete = degree == sites - 1;
  if (!complete && (degree < 2 || degree % 2 != 0 || degree >= sites)) {
    return InvalidArgument("secagg: neighbour graph degree {} over {} sites: must be even in [2, {}), or {} "
                           "(complete)",
                           degree, sites, sites, sites - 1);
  }
  // Every site builds the whole graph, so its size is bounded where a setup
  // from the server could otherwise make a site allocate without limit.
  if (uint64_t(sites) * uint64_t(degree) > kMaxGraphEntries) {
    return InvalidArgument("secagg: neighbour graph of {} sites with degree {}: {} entries, more than 2^24", sites,
                           degree, uint64_t(sites) * uint64_t(degree));
  }
  // position -> site: Fisher–Yates with unbiased draws from the round stream.
  std::vector<uint32_t> site_at(sites);
  for (int i = 0; i < sites; ++i) site_at[i] = static_cast<uint32_t>(i);
  StreamWords words(round_seed);
  for (uint64_t i = sites; i > 1; --i) {
    const uint64_t reject_below = (0 - i) % i;  // 2^64 mod i
    uint64_t draw = 0;
    do {
      ESTUARY_ASSIGN_OR_RETURN(draw, words.Next());
    } while (draw < reject_below);
    std::swap(site_at[i - 1], site_at[draw % i]);
  }

  NeighbourGraph graph;
  graph.degree_ = degree;
  graph.neighbours_.resize(sites);
  for (int position = 0; position < sites; ++position) {
    auto& mine = graph.neighbours_[site_at[position]];
    if (complete) {
      for (int other = 0; other < sites; ++other) {
        if (other != position) mine.push_back(site_at[other]);
      }
    } else {
      for (int step = 1; step <= degree / 2; ++step) {
        mine.push_back(site_at[(position + step) % sites]);
        mine.push_back(site_at[(position + sites - step) % sites]);
      }
    }
    std::sort(mine.begin(), mine.end());
  }
  return graph;
}

bool NeighbourGraph::Adjacent(uint32_t a, uint32_t b) const {
  if (a >= neighbours_.size()) return false;
  return std::binary_search(neighbours_[a].begin(), neighbours_[a].end(), b);
}

}  // namespace estuary::secagg
