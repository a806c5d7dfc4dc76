// Adaptive clipping against numpy_adaptive_clip.py (Andrew et al.'s update,
// transcribed in NumPy), which ctest runs first as a fixture and which writes
// ESTUARY_ADAPTIVE_CLIP_ORACLE.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "aggregation/dp_fedavg.h"
#include "aggregation/fedavg.h"
#include "tests/aggregation/oracle_file.h"

namespace estuary::aggregation {
namespace {

using testing::ReadOracleFile;
using testing::ReadValues;

struct Oracle {
  uint64_t sampled = 0;
  double clip = 0, quantile = 0, lr = 0;
  std::vector<std::vector<double>> norms;
  std::vector<std::pair<double, double>> after;  // (released mean, clip)
  std::vector<std::array<double, 3>> z_deltas;   // (z, σ_b, z_Δ)
};

bool Load(const std::string& path, Oracle& oracle, std::string& error) {
  auto read = [&](const std::string& tag, std::istringstream& line) {
    if (tag == "options") {
      line >> oracle.sampled >> oracle.clip >> oracle.quantile >> oracle.lr;
    } else if (tag == "round") {
      size_t reported = 0;
      line >> reported;
      oracle.norms.push_back(ReadValues<double>(line, reported));
    } else if (tag == "after") {
      double mean = 0, clip = 0;
      line >> mean >> clip;
      oracle.after.emplace_back(mean, clip);
    } else if (tag == "z_delta") {
      std::array<double, 3> z{};
      line >> z[0] >> z[1] >> z[2];
      oracle.z_deltas.push_back(z);
    } else {
      return false;
    }
    return true;
  };
  if (!ReadOracleFile(path, "estuary-dp-adaptive-clip-oracle 1", "numpy_adaptive_clip", read, error)) return false;
  if (oracle.norms.empty() || oracle.norms.size() != oracle.after.size() || oracle.z_deltas.empty()) {
    error = path + ": incomplete oracle file";
    return false;
  }
  return true;
}

// σ_b and z so small that the count's noise (σ_b / k ≈ 5e-14) and the sum's
// are invisible: the trajectory is then the update rule's alone.
TEST(DpAdaptiveClipOracleTest, TheClipNormFollowsThePapersGeometricUpdate) {
  Oracle oracle;
  std::string error;
  ASSERT_TRUE(Load(ESTUARY_ADAPTIVE_CLIP_ORACLE, oracle, error)) << error;
  DpFedAvg dp(std::make_unique<FedAvg>(),
              {.noise_multiplier = 1e-12, .clip = oracle.clip, .adaptive = true, .target_quantile = oracle.quantile,
               .clip_lr = oracle.lr, .clipped_count_stddev = 1e-12, .seed = 3},
              std::nullopt);
  for (size_t r = 0; r < oracle.norms.size(); ++r) {
    std::vector<float> global(2, 0.0f);
    dp.PlanRound(oracle.sampled);
    ASSERT_TRUE(dp.Begin(r + 1, global).ok());
    for (double norm : oracle.norms[r]) {
      const std::vector<float> update = {float(norm), 0.0f};
      ASSERT_TRUE(dp.Fold(update, 1).ok());
    }
    ASSERT_TRUE(dp.Finish(global).ok());
    // The norms travel as float, the reference used them in double.
    EXPECT_NEAR(global[0], oracle.after[r].first, 1e-6 * oracle.after[r].first + 1e-7) << "round " << r + 1;
    EXPECT_NEAR(dp.clip(), oracle.after[r].second, 1e-6 * oracle.after[r].second) << "round " << r + 1;
  }
  // It must have travelled: from 0.1 to about the 0.7 quantile of the norms.
  EXPECT_GT(dp.clip(), 10 * oracle.clip);
}

TEST(DpAdaptiveClipOracleTest, TheSumsNoiseMultiplierLeavesTheCountItsShareOfTheBudget) {
  Oracle oracle;
  std::string error;
  ASSERT_TRUE(Load(ESTUARY_ADAPTIVE_CLIP_ORACLE, oracle, error)) << error;
  for (const auto& [z, count_stddev, expected] : oracle.z_deltas) {
    auto z_delta = DpFedAvg::SumNoiseMultiplier(
        {.noise_multiplier = z, .adaptive = true, .clipped_count_stddev = count_stddev}, 100);
    ASSERT_TRUE(z_delta.ok()) << z_delta.status().ToString();
    EXPECT_NEAR(*z_delta, expected, 1e-12 * expected) << "z " << z << ", sigma_b " << count_stddev;
  }
}

}  // namespace
}  // namespace estuary::aggregation
