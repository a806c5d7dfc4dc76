// The neighbour graph of SecAgg+ (Bell et al., CCS 2020): each site masks
// pairwise only with its k neighbours and shares its secrets only among
// them, so a site's cost grows with k, not with the number of sites n.
//
// The graph is a Harary graph H(k, n) — positions 0..n−1 on a ring, each
// joined to the k/2 positions either side — with sites placed on the ring by
// a random permutation, as Bell et al. do. The permutation is Fisher–Yates
// driven by the AES-256-CTR stream (secagg/prg.h) of a round seed that all parties share, so
// every party builds the same graph, while a site cannot pick its neighbours.
//
// Degree. DefaultDegree(n) = min(n − 1, 2 · ceil(1.5 · log2 n)): k grows as
// about 3 · log2 n and is even (a Harary graph of even degree is defined for
// every n > k); n = 100, 1000, 10000 give k = 20, 30, 40. Bell et al. show
// k = O(log n) suffices for security and correctness with a constant fraction
// of corrupt and dropped sites; the constant 3 is this library's choice, not
// tuned to their bounds. When k reaches n − 1 the graph is complete (plain
// SecAgg), which is what small federations get.
//
// Threshold. DefaultThreshold(k) = floor(k / 2) + 1, the smallest strict
// majority of a neighbourhood. Each honest neighbour reveals, for a site u,
// either the share of u's self-mask seed (u survived) or of u's mask key (u
// dropped), never both; with t > k/2 two disjoint groups of t cannot both
// exist among u's k neighbours, so the server cannot obtain both secrets of
// one site from honest answers. It also tolerates up to k − t = ceil(k/2) − 1
// dropped neighbours per site. Bell et al. tune t with k from their bounds on
// corruption and dropout; a majority is the conservative choice until those
// parameters are set per federation.
#pragma once

#include <cstdint>
#include <vector>

#include "base/status.h"
#include "secagg/bytes.h"

namespace estuary::secagg {

int DefaultDegree(int sites);
int DefaultThreshold(int degree);

inline constexpr uint64_t kMaxGraphEntries = uint64_t{1} << 24;

// Whether Harary(sites, degree, ·) exists and is small enough to build,
// without building it: the refusals Harary and SiteNeighbours::Of give.
Status CheckGraphShape(int sites, int degree);

class NeighbourGraph {
 public:
  // Sites are 0..sites−1. degree must be even with 2 <= degree < sites, or
  // sites − 1 (complete graph), for 2 <= sites; sites × degree at most
  // kMaxGraphEntries (2^24: a million sites at degree 16, or the complete
  // graph of 4,096).
  static Result<NeighbourGraph> Harary(int sites, int degree, const Key32& round_seed);

  int sites() const { return static_cast<int>(neighbours_.size()); }
  int degree() const { return degree_; }
  // Sorted ascending, without `site` itself.
  const std::vector<uint32_t>& Neighbours(uint32_t site) const { return neighbours_.at(site); }
  bool Adjacent(uint32_t a, uint32_t b) const;

 private:
  int degree_ = 0;
  std::vector<std::vector<uint32_t>> neighbours_;
};

// One site's neighbours in the graph Harary(sites, degree, round_seed) builds:
// what a site keeps (k ids) instead of the whole graph (n · k ids, 2 MB a site
// at n = 10,000). Finding them still draws the whole permutation (4n bytes,
// freed before Of returns), so building one costs O(n) time, a keystream word
// and a swap per site; the complete graph keeps its n − 1 ids.
class SiteNeighbours {
 public:
  // The same arguments, and refusals, as Harary; site < sites.
  static Result<SiteNeighbours> Of(uint32_t site, int sites, int degree, const Key32& round_seed);

  // Sorted ascending, without the site itself.
  const std::vector<uint32_t>& ids() const { return ids_; }
  bool Contains(uint32_t other) const;

 private:
  std::vector<uint32_t> ids_;
};

}  // namespace estuary::secagg
