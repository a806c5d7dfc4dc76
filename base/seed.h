// Seed mixing and draws that give the same bits on every platform.
//
// One seed drives a whole federation; every consumer (sampling, partitioning,
// initialisation, shuffling) derives its own stream with MixSeed, so streams
// are independent and reruns identical. The std:: distributions are
// implementation-defined, hence the explicit bounded draw.
#pragma once

#include <cstdint>
#include <random>
#include <string_view>
#include <utility>
#include <vector>

namespace estuary {

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline uint64_t MixSeed(uint64_t a, uint64_t b) { return SplitMix64(a ^ SplitMix64(b)); }

inline uint64_t MixSeed(uint64_t a, std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return MixSeed(a, h);
}

// Uniform integer in [0, bound), bound > 0: rejects the 2^64 mod bound lowest
// draws so every residue is equally likely.
template <typename Uint64Generator>
uint64_t UniformBelow(Uint64Generator& generator, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;
  for (;;) {
    const uint64_t r = generator();
    if (r >= threshold) return r % bound;
  }
}

// Fisher-Yates over the whole vector.
template <typename T>
void Shuffle(std::vector<T>& items, std::mt19937_64& rng) {
  for (size_t i = items.size(); i > 1; --i) std::swap(items[i - 1], items[UniformBelow(rng, i)]);
}

}  // namespace estuary
