#include "aggregation/sampling.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <unordered_map>

#include <openssl/rand.h>

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

std::vector<uint64_t> SampleIndices(uint64_t n, size_t k, uint64_t seed, uint64_t round) {
  k = size_t(std::min<uint64_t>(k, n));
  std::mt19937_64 generator(MixSeed(seed, round));
  // position -> the index now there, for the positions a swap has touched;
  // every other position still holds its own index.
  std::unordered_map<uint64_t, uint64_t> moved;
  moved.reserve(2 * k);
  auto at = [&](uint64_t position) {
    const auto it = moved.find(position);
    return it == moved.end() ? position : it->second;
  };
  std::vector<uint64_t> chosen(k);
  for (size_t i = 0; i < k; ++i) {
    const uint64_t j = i + UniformBelow(generator, n - i);
    const uint64_t here = at(i);  // position i is never read again
    chosen[i] = at(j);
    moved[j] = here;
  }
  std::sort(chosen.begin(), chosen.end());
  return chosen;
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

namespace {

std::vector<std::string> Distinct(std::vector<std::string> names) {
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

}  // namespace

std::vector<std::string> PoissonSampleClients(const std::vector<std::string>& names, double q, uint64_t seed,
                                              uint64_t round) {
  const uint64_t round_seed = MixSeed(MixSeed(seed, round), "poisson sampling");
  std::vector<std::string> joined;
  for (std::string& name : Distinct(names)) {
    const double u = double(MixSeed(round_seed, name) >> 11) * 0x1p-53;
    if (u < q) joined.push_back(std::move(name));
  }
  return joined;
}

Result<std::vector<std::string>> PoissonSampleClientsUnpredictably(const std::vector<std::string>& names, double q) {
  std::vector<std::string> distinct = Distinct(names);
  std::vector<uint64_t> words(distinct.size());
  if (!words.empty() &&
      RAND_bytes(reinterpret_cast<unsigned char*>(words.data()), int(words.size() * sizeof(uint64_t))) != 1) {
    return Internal("sampling: RAND_bytes refused {} bytes for Poisson sampling", words.size() * sizeof(uint64_t));
  }
  std::vector<std::string> joined;
  for (size_t i = 0; i < distinct.size(); ++i) {
    if (double(words[i] >> 11) * 0x1p-53 < q) joined.push_back(std::move(distinct[i]));
  }
  return joined;
}

}  // namespace estuary::aggregation
