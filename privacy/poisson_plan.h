// How much room a run of Poisson sampling plans for: each of N sites joins
// a round independently with probability q, so a round's size is
// Binomial(N, q) and varies. Distributed DP plans its noise shares and its
// ring for the run, not the round's draw (privacy/distributed_dp.h,
// DistributedDpOptions::max_sites), and estuary-sim and estuary-server must
// plan alike: both take the maximum from here.
#pragma once

#include <cstdint>

namespace estuary::privacy {

// The most sites a round of Poisson sampling (rate q over `sites`) plans
// room for: the expected q·N plus six standard deviations, plus one, at most
// N. A draw above it has probability below 1e-9, and must be refused
// (estuary-sim ends its run, estuary-server fails the round).
uint32_t PoissonPlannedMaximum(uint32_t sites, double q);

}  // namespace estuary::privacy
