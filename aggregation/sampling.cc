#include "aggregation/sampling.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace estuary::aggregation {
std::vector<std::string> SampleClients(std::vector<std::string> connected, size_t k, uint64_t seed, uint64_t round) {
  // Sorting first makes the result independent of connection order.
  std::sort(connected.begin(), connected.end());
  connected.erase(std::unique(connected.begin(), connected.end()), connected.end());
  const size_t n = connected.size();
  k = std::min(k, n);
  // std::mt19937_64's output sequence is fixed by the standard, unlike the
  // distributions, so together with UniformBelow the draw is portable.
  std::mt19937_64 generator(MixSeed(seed, round));
  // Partial Fisher-Yates: after step i, connected[0..i] is a uniform sample.
  for (size_t i = 0; i < k; ++i) {
    const size_t j = i + static_cast<size_t>(UniformBelow(generator, n - i));
    std::swap(connected[i], connected[j]);
  }
  connected.resize(k);
  std::sort(connected.begin(), connected.end());
  return connected;
}

size_t ClientsPerRound(double fraction_or_count, size_t connected) {
  if (!(fraction_or_count > 0) || connected == 0) return 0;
  if (fraction_or_count >= 1) {
    if (fraction_or_count >= static_cast<double>(connected)) return connected;
    return std::min(connected, static_cast<size_t>(fraction_or_count));
  }
  // fraction * connected can land a hair above an integer (0.7 * 10 is
  // 7.000000000000001), which a plain ceil would round up to 8; forgive
  // relative error at the level of double rounding.
  const double exact = fraction_or_count * static_cast<double>(connected);
  const double wanted = std::ceil(exact - exact * 1e-12);
  return std::clamp<size_t>(static_cast<size_t>(wanted), 1, connected);
}

}  // namespace estuary::aggregation
