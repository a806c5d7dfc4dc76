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

namespace estuary::aggregation {

// Picks min(k, #distinct names) distinct names from `connected` uniformly at
// random, and returns them sorted. Duplicate names count once.
std::vector<std::string> SampleClients(std::vector<std::string> connected, size_t k, uint64_t seed, uint64_t round);

// How many clients to sample: a value >= 1 is a count (fractional part
// dropped), 0 < value < 1 a fraction of `connected` rounded up (at least 1).
// Clamped to `connected`. Zero for a value that is <= 0 or NaN; validate
// configuration before it gets here.
size_t ClientsPerRound(double fraction_or_count, size_t connected);

// Well-mixed 64-bit seeds derived from a base seed: splitmix64(a ^ splitmix64(b)).
// The string form hashes s with 64-bit FNV-1a first. For any component that
// needs its own reproducible random stream (per round, per client).
uint64_t MixSeed(uint64_t a, uint64_t b);
uint64_t MixSeed(uint64_t a, std::string_view s);

// An unbiased draw in [0, bound) from a 64-bit generator, defined here rather
// than left to std::uniform_int_distribution, whose algorithm differs between
// standard libraries. bound must be > 0.
template <typename Uint64Generator>
uint64_t UniformBelow(Uint64Generator& generator, uint64_t bound) {
  // Reject the top partial block of 2^64 mod bound values so every residue is
  // equally likely; at most half the draws are rejected, usually almost none.
  const uint64_t threshold = (0 - bound) % bound;  // == 2^64 mod bound
  for (;;) {
    const uint64_t r = generator();
    if (r >= threshold) return r % bound;
  }
}

}  // namespace estuary::aggregation
