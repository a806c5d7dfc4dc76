// Client sampling: which connected clients take part in a round.
//
// Deterministic in (connected set, k, seed, round), independent of the order
// in which clients connected and of the standard library in use, so the server
// and the simulator, or two runs on different machines, pick the same clients.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/seed.h"
#include "base/status.h"

namespace estuary::aggregation {

// Picks min(k, #distinct names) distinct names from `connected` uniformly at
// random, and returns them sorted. Duplicate names count once.
std::vector<std::string> SampleClients(std::vector<std::string> connected, size_t k, uint64_t seed, uint64_t round);

// The same draw over the indices 0 .. n-1 of n clients whose names sort in
// index order: SampleClients(names, k, seed, round) are the names of
// SampleIndices(n, k, seed, round), ascending. O(k) time and memory whatever
// n is (a partial Fisher-Yates over an implicit array, the swapped entries in
// a hash map), so a simulator samples a round from millions of sites without
// listing them.
std::vector<uint64_t> SampleIndices(uint64_t n, size_t k, uint64_t seed, uint64_t round);

// How many clients to sample: a value >= 1 is a count (fractional part
// dropped), 0 < value < 1 a fraction of `connected` rounded up (at least 1).
// Clamped to `connected`. Zero for a value that is <= 0 or NaN; validate
// configuration before it gets here.
size_t ClientsPerRound(double fraction_or_count, size_t connected);

// Poisson sampling (serve --sample-rate): each distinct name joins
// independently with probability q ∈ [0, 1], so a round's size varies
// (Binomial(N, q)); this is the sampling the privacy accountant assumes
// (privacy/accountant.h). Sorted. Seeded: name i joins when a uniform on the
// 2^-53 grid from MixSeed(seed, round, name) is below q — the draw of
// estuary-sim --sample-rate, so a site's membership does not depend on which
// other sites exist. Unpredictably: the uniforms come from RAND_bytes, so no
// reader of the seed or the log can tell who will be drawn; fails only when
// OpenSSL cannot give random bytes.
std::vector<std::string> PoissonSampleClients(const std::vector<std::string>& names, double q, uint64_t seed,
                                              uint64_t round);
Result<std::vector<std::string>> PoissonSampleClientsUnpredictably(const std::vector<std::string>& names, double q);

// Seed mixing and the portable bounded draw live in base/seed.h; they are
// re-exported here because sampling is where most readers look for them.
using ::estuary::MixSeed;
using ::estuary::UniformBelow;

}  // namespace estuary::aggregation
