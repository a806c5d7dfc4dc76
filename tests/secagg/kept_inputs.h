// The oracle of the secure-aggregation tests: the quantised inputs sites
// kept (--secagg-keep-input, AgentOptions' keep directory), summed in the
// clear mod 2^32, dequantised and folded by FedAvg — what the server must
// have committed, bit for bit, had the masks cancelled.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "aggregation/strategy.h"
#include "secagg/quantize.h"

namespace estuary::testing {

// What one site contributed to a round: the quantised input it kept, and its weight.
struct Contribution {
  std::vector<uint32_t> quantized;
  uint64_t weight = 0;
};

// Every round-R.site-U.w-W.u32 file under `dir` (with `suffix` ".noise":
// a distributed-DP site's noise share, round-R.site-U.w-W.noise.u32).
inline std::vector<Contribution> KeptInputs(const std::filesystem::path& dir, uint64_t round, const std::string& suffix = "") {
  std::vector<Contribution> out;
  const std::regex name(fmt::format(R"(round-{}\.site-\d+\.w-(\d+){}\.u32)", round, suffix));
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    std::smatch m;
    const std::string file = entry.path().filename().string();
    if (!std::regex_match(file, m, name)) continue;
    std::ifstream in(entry.path(), std::ios::binary);
    std::string bytes{std::istreambuf_iterator<char>(in), {}};
    Contribution c{.quantized = std::vector<uint32_t>(bytes.size() / 4), .weight = std::stoull(m[1].str())};
    std::memcpy(c.quantized.data(), bytes.data(), bytes.size());
    out.push_back(std::move(c));
  }
  return out;
}

// Plain aggregation of the same quantised inputs: their sum mod 2^32,
// dequantised with the round's scale, folded by FedAvg into `previous`.
// `denominator` > 0: the mean divides by it instead of the inputs' weight
// (distributed DP under Poisson sampling: q · total_sites).
inline std::vector<float> PlainAggregate(const std::vector<Contribution>& inputs, double clip, double scale,
                                  std::vector<float> previous, uint64_t round, double denominator = 0) {
  std::vector<uint32_t> sum(previous.size(), 0);
  double weight = 0;
  for (const Contribution& c : inputs) {
    EXPECT_EQ(c.quantized.size(), sum.size());
    for (size_t i = 0; i < sum.size() && i < c.quantized.size(); ++i) sum[i] += c.quantized[i];
    weight += double(c.weight);
  }
  auto mean = secagg::Dequantize(sum, denominator > 0 ? denominator : weight,
                                 {.bits = 32, .clip_norm = clip, .scale = scale});
  EXPECT_TRUE(mean.ok()) << mean.status().ToString();
  const std::vector<float> mean_f(mean->begin(), mean->end());
  auto fedavg = aggregation::MakeStrategy({.name = "fedavg"});
  EXPECT_TRUE(fedavg.ok());
  EXPECT_TRUE((*fedavg)->Begin(round, previous).ok());
  EXPECT_TRUE((*fedavg)->Fold(mean_f, weight).ok());
  EXPECT_TRUE((*fedavg)->Finish(previous).ok());
  return previous;
}

}  // namespace estuary::testing
