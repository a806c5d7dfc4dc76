// Poisson sampling of a round's sites (estuary-sim --sample-rate Q): each
// site joins independently with probability q, so the number taking part
// varies from round to round (Binomial(N, q)). This is the sampling the
// privacy accountant's amplification assumes (privacy/accountant.h); the
// fixed-size sampling of --per-round is the customary approximation to it.
//
// Deterministic in (names, q, seed, round): site i's draw is a uniform on the
// 2^-53 grid from SplitMix64 of the seed, the round and the site's name, so a
// site's membership does not depend on which other sites exist or their order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "privacy/poisson_plan.h"

namespace estuary::simulations {

// The names that join round `round`, sorted; q in [0, 1].
std::vector<std::string> PoissonSample(const std::vector<std::string>& names, double q, uint64_t seed, uint64_t round);

// The same sampling over sites 0 .. n-1 known by index (population.h), in
// O(sites drawn) whatever n is: the successes of n Bernoulli(q) trials, drawn
// as the geometric gaps between them (floor(log U / log(1 - q))) from the
// seed and the round. Ascending. A different stream from PoissonSample's.
std::vector<uint64_t> PoissonSampleIndices(uint64_t n, double q, uint64_t seed, uint64_t round);

// The most sites a round of Poisson sampling plans room for: the expected
// q·N plus six standard deviations, plus one, at most N. A draw above it has
// probability below 1e-9; the simulator ends such a run with one line. In
// privacy/poisson_plan.h, so that estuary-server plans as the simulator does.
using privacy::PoissonPlannedMaximum;

}  // namespace estuary::simulations
