// The distributed discrete Gaussian's ε against ddg_oracle.py (a plain-Python
// transcription of Kairouz, Liu and Steinke's Prop. 14 and Zhu and Wang's
// subsampling bound with the tight conversion), which ctest runs first as a
// fixture and which writes ESTUARY_DDG_ORACLE: six cases, τ = 0 and τ > 0,
// q = 1 and q < 1, a given L1 sensitivity, and the MNIST flagship's run.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>

#include "privacy/accountant.h"
#include "privacy/distributed_dp.h"

namespace estuary::privacy {
namespace {

TEST(DistributedDiscreteGaussianOracle, EpsilonEqualsThePythonTranscription) {
  std::ifstream in(ESTUARY_DDG_ORACLE);
  ASSERT_TRUE(in) << ESTUARY_DDG_ORACLE << ": missing (ctest runs privacy.ddg_oracle first)";
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  ASSERT_EQ(line, "estuary-ddg-oracle 1");
  int cases = 0;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string tag;
    double q, l2, l1, variance, sites, dimension, rounds, delta, expected;
    fields >> tag >> q >> l2 >> l1 >> variance >> sites >> dimension >> rounds >> delta >> expected;
    ASSERT_EQ(tag, "case") << line;
    ASSERT_FALSE(fields.fail()) << line;
    const DistributedDiscreteGaussian mechanism{.l2_sensitivity = l2, .l1_sensitivity = l1,
                                                .site_variance = variance, .sites = int64_t(sites),
                                                .dimension = int64_t(dimension)};
    auto accountant = *Accountant::Create(delta);
    const auto per_round = SampledDistributedDiscreteGaussianRdp(q, mechanism, accountant.orders());
    ASSERT_TRUE(per_round.ok()) << per_round.status().ToString();
    for (int r = 0; r < int(rounds); ++r) ASSERT_TRUE(accountant.AddRoundRdp(*per_round).ok());
    EXPECT_NEAR(accountant.Spent().epsilon, expected, 1e-9 * expected) << line;
    EXPECT_GT(expected, 0) << line;
    ++cases;
  }
  EXPECT_EQ(cases, 6);
}

}  // namespace
}  // namespace estuary::privacy
