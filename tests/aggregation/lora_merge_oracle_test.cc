// Exact LoRA merging against torch.linalg.svd (see torch_lora_svd.py, which
// ctest runs first as a fixture and which writes ESTUARY_LORA_SVD_ORACLE): the
// singular values lora_merge.cc finds by QR of the stacked factors are those
// of a dense SVD of the averaged ΔW, and the merged rank-r adapter carries
// exactly the leading r of them.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <sstream>

#include "aggregation/lora_merge.h"
#include "tests/aggregation/oracle_file.h"

namespace estuary::aggregation {
namespace {

struct Oracle {
  size_t out = 0, in = 0, clients = 0, target_rank = 0;
  float target_alpha = 0;
  std::vector<LoraAdapter> adapters;
  std::vector<double> weights;
  std::vector<double> sigma;
};

using testing::ReadOracleFile;
using testing::ReadValues;

bool Load(const std::string& path, Oracle& oracle, std::string& error) {
  auto read = [&](const std::string& tag, std::istringstream& line) {
    if (tag == "shape") {
      line >> oracle.out >> oracle.in >> oracle.clients >> oracle.target_rank >> oracle.target_alpha;
    } else if (tag == "client") {
      LoraAdapter adapter{.in = oracle.in, .out = oracle.out};
      double weight = 0;
      line >> weight >> adapter.rank >> adapter.alpha;
      oracle.weights.push_back(weight);
      oracle.adapters.push_back(adapter);
    } else if (tag == "a" && !oracle.adapters.empty()) {
      oracle.adapters.back().a = ReadValues<float>(line, oracle.adapters.back().rank * oracle.in);
    } else if (tag == "b" && !oracle.adapters.empty()) {
      oracle.adapters.back().b = ReadValues<float>(line, oracle.out * oracle.adapters.back().rank);
    } else if (tag == "sigma") {
      size_t stacked = 0;
      for (const auto& a : oracle.adapters) stacked += a.rank;
      oracle.sigma = ReadValues<double>(line, std::min({stacked, oracle.out, oracle.in}));
    } else {
      return false;
    }
    return true;
  };
  if (!ReadOracleFile(path, "estuary-lora-svd-oracle 1", "torch_lora_svd", read, error)) return false;
  if (oracle.adapters.size() != oracle.clients || oracle.sigma.empty() || oracle.target_rank == 0) {
    error = path + ": incomplete oracle file";
    return false;
  }
  return true;
}

TEST(LoraMergeOracle, SingularValuesMatchTorchSvd) {
  Oracle oracle;
  std::string error;
  ASSERT_TRUE(Load(ESTUARY_LORA_SVD_ORACLE, oracle, error)) << error;
  auto merged = MergeLoraModule("oracle", oracle.adapters, oracle.weights,
                                {.rule = LoraMergeRule::kExact, .rank = oracle.target_rank, .alpha = oracle.target_alpha});
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();

  ASSERT_EQ(merged->singular_values.size(), oracle.sigma.size());
  double worst = 0;
  for (size_t j = 0; j < oracle.sigma.size(); ++j) {
    const double relative = std::abs(merged->singular_values[j] - oracle.sigma[j]) / oracle.sigma[j];
    worst = std::max(worst, relative);
    EXPECT_LE(relative, 1e-4) << "sigma[" << j << "]: " << merged->singular_values[j] << " vs torch " << oracle.sigma[j];
  }
  std::printf("%zu singular values against torch.linalg.svd: worst relative difference %.3g\n", oracle.sigma.size(),
              worst);

  // The merged adapter is the best rank-r approximation: its (alpha/r)·B'·A'
  // has Frobenius norm √(Σ_{j<r} σ_j²) of torch's σ, and the residual the rest.
  double head2 = 0, tail2 = 0;
  for (size_t j = 0; j < oracle.sigma.size(); ++j) (j < oracle.target_rank ? head2 : tail2) += oracle.sigma[j] * oracle.sigma[j];
  double adapter2 = 0, residual2 = 0;
  for (float v : LoraDelta(merged->adapter)) adapter2 += double(v) * v;
  for (float v : merged->residual.Dense()) residual2 += double(v) * v;
  EXPECT_NEAR(std::sqrt(adapter2), std::sqrt(head2), 1e-4 * std::sqrt(head2));
  EXPECT_NEAR(std::sqrt(residual2), std::sqrt(tail2), 1e-4 * std::sqrt(tail2));
}

}  // namespace
}  // namespace estuary::aggregation
