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

Status CheckGraphShape(int sites, int degree) {
  if (sites < 2) return InvalidArgument("secagg: neighbour graph over {} sites: need at least 2", sites);
  const bool complete = degree == sites - 1;
  if (!complete && (degree < 2 || degree % 2 != 0 || degree >= sites)) {
    return InvalidArgument("secagg: neighbour graph degree {} over {} sites: must be even in [2, {}), or {} "
                           "(complete)",
                           degree, sites, sites, sites - 1);
  }
  // The graph's size is bounded where a setup from the server could
  // otherwise make a party allocate without limit.
  if (uint64_t(sites) * uint64_t(degree) > kMaxGraphEntries) {
    return InvalidArgument("secagg: neighbour graph of {} sites with degree {}: {} entries, more than 2^24", sites,
                           degree, uint64_t(sites) * uint64_t(degree));
  }
  return Status::Ok();
}

namespace {

// position -> site: Fisher–Yates with unbiased draws from the round stream.
Result<std::vector<uint32_t>> SitesByPosition(int sites, const Key32& round_seed) {
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
  return site_at;
}

// The sites joined to `position` on the ring, sorted.
std::vector<uint32_t> RingNeighbours(const std::vector<uint32_t>& site_at, int position, int degree) {
  const int sites = static_cast<int>(site_at.size());
  std::vector<uint32_t> mine;
  mine.reserve(degree);
  for (int step = 1; step <= degree / 2; ++step) {
    mine.push_back(site_at[(position + step) % sites]);
    mine.push_back(site_at[(position + sites - step) % sites]);
  }
  std::sort(mine.begin(), mine.end());
  return mine;
}

}  // namespace

Result<NeighbourGraph> NeighbourGraph::Harary(int sites, int degree, const Key32& round_seed) {
  ESTUARY_RETURN_IF_ERROR(CheckGraphShape(sites, degree));
  NeighbourGraph graph;
  graph.degree_ = degree;
  graph.neighbours_.resize(sites);
  if (degree == sites - 1) {  // complete: the permutation changes nothing
    for (int site = 0; site < sites; ++site) {
      auto& mine = graph.neighbours_[site];
      for (int other = 0; other < sites; ++other) {
        if (other != site) mine.push_back(static_cast<uint32_t>(other));
      }
    }
    return graph;
  }
  ESTUARY_ASSIGN_OR_RETURN(std::vector<uint32_t> site_at, SitesByPosition(sites, round_seed));
  for (int position = 0; position < sites; ++position) {
    graph.neighbours_[site_at[position]] = RingNeighbours(site_at, position, degree);
  }
  return graph;
}

Result<SiteNeighbours> SiteNeighbours::Of(uint32_t site, int sites, int degree, const Key32& round_seed) {
  ESTUARY_RETURN_IF_ERROR(CheckGraphShape(sites, degree));
  if (site >= uint32_t(sites)) return InvalidArgument("secagg: site {} is not among the graph's {} sites", site, sites);
  SiteNeighbours out;
  if (degree == sites - 1) {
    out.ids_.reserve(sites - 1);
    for (int other = 0; other < sites; ++other) {
      if (uint32_t(other) != site) out.ids_.push_back(static_cast<uint32_t>(other));
    }
    return out;
  }
  ESTUARY_ASSIGN_OR_RETURN(std::vector<uint32_t> site_at, SitesByPosition(sites, round_seed));
  const int position = static_cast<int>(std::find(site_at.begin(), site_at.end(), site) - site_at.begin());
  out.ids_ = RingNeighbours(site_at, position, degree);
  return out;
}

bool SiteNeighbours::Contains(uint32_t other) const { return std::binary_search(ids_.begin(), ids_.end(), other); }

bool NeighbourGraph::Adjacent(uint32_t a, uint32_t b) const {
  if (a >= neighbours_.size()) return false;
  return std::binary_search(neighbours_[a].begin(), neighbours_[a].end(), b);
}

}  // namespace estuary::secagg
