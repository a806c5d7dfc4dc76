// The Rényi DP of the distributed discrete Gaussian (Kairouz, Liu and Steinke
// 2021, Prop. 14) and of its Poisson-subsampled rounds (Zhu and Wang 2019's
// general bound): the Gaussian limit, the τ penalty of small shares, the
// subsampling bound written out by hand at orders 2 and 3, and that it is an
// upper bound on the exact sampled Gaussian where both apply.
#include "privacy/distributed_dp.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cmath>

#include "privacy/accountant.h"

namespace estuary::privacy {
namespace {

// A sum of n shares of variance V with sensitivity Δ: noise multiplier √(nV)/Δ.
DistributedDiscreteGaussian Mechanism(double z, int64_t sites, double sensitivity = 1e6, int64_t dimension = 199210) {
  const double variance = z * z * sensitivity * sensitivity / double(sites);
  return {.l2_sensitivity = sensitivity, .site_variance = variance, .sites = sites, .dimension = dimension};
}

TEST(DistributedDiscreteGaussian, LargeSharesAreTheGaussianMechanism) {
  for (double z : {0.5, 1.0, 3.0}) {
    const auto m = Mechanism(z, 100);
    EXPECT_EQ(*DistributedDiscreteGaussianTau(m), 0);
    for (double order : {1.5, 2.0, 10.0, 64.0}) {
      EXPECT_NEAR(*DistributedDiscreteGaussianRdp(m, order), order / (2 * z * z), 1e-12 * order / (z * z));
    }
    // q = 1 through the sampled form is the same; q = 0 is nothing.
    const std::vector<double> orders = {2, 8, 32};
    EXPECT_NEAR(SampledDistributedDiscreteGaussianRdp(1, m, orders)->at(1), 8 / (2 * z * z), 1e-12);
    EXPECT_EQ(SampledDistributedDiscreteGaussianRdp(0, m, orders)->at(2), 0);
  }
}

TEST(DistributedDiscreteGaussian, SmallSharesPayTau) {
  // σ² = 1 per site, 10 sites: τ = 10 Σ_{k=1}^{9} exp(−2π² k/(k+1)).
  const DistributedDiscreteGaussian m{.l2_sensitivity = 3, .site_variance = 1, .sites = 10, .dimension = 1000};
  long double tau = 0;
  for (int k = 1; k < 10; ++k) tau += std::exp(-2 * M_PI * M_PI * k / (k + 1.0L));
  EXPECT_NEAR(*DistributedDiscreteGaussianTau(m), double(10 * tau), 1e-15);
  EXPECT_GT(tau, 1e-5);
  // Each of Prop. 14's terms exceeds the Gaussian's α Δ²/(2nσ²): so does the least.
  const double gaussian = 4 * 9 / (2 * 10.0);
  const double rdp = *DistributedDiscreteGaussianRdp(m, 4);
  EXPECT_GT(rdp, gaussian);
  // Prop. 14's three terms at α = 4 with Δ₁ = Δ₂ · min(√d, Δ₂) = 9.
  const double t = double(10 * tau), l2 = 3 / std::sqrt(10.0), l1 = 9 / std::sqrt(10.0);
  const double first = 2 * l2 * l2 + t * 1000, second = 2 * (l2 * l2 + 2 * l1 * t + t * t * 1000),
               third = 2 * std::pow(l2 + t * std::sqrt(1000.0), 2);
  EXPECT_NEAR(rdp, std::min({first, second, third}), 1e-12);
  // One site has no τ.
  EXPECT_EQ(*DistributedDiscreteGaussianTau({.l2_sensitivity = 3, .site_variance = 1, .sites = 1, .dimension = 1}), 0);
}

TEST(DistributedDiscreteGaussian, SubsampledBoundWrittenOutAtOrdersTwoAndThree) {
  const double q = 0.1, z = 1.3;
  const auto m = Mechanism(z, 50);
  auto e = [&](double a) { return a / (2 * z * z); };
  const double two = std::log((1 - q) * (1 + q) + q * q * std::exp(e(2)));
  const double three = std::log((1 - q) * (1 - q) * (1 + 2 * q) + 3 * q * q * (1 - q) * std::exp(e(2)) +
                                3 * q * q * q * std::exp(2 * e(3))) / 2;
  const std::vector<double> orders = {2, 3, 2.5};
  const auto rdp = *SampledDistributedDiscreteGaussianRdp(q, m, orders);
  EXPECT_NEAR(rdp[0], std::min(two, e(2)), 1e-14);
  EXPECT_NEAR(rdp[1], std::min(three, e(3)), 1e-14);
  EXPECT_NEAR(rdp[2], std::min(three, e(2.5)), 1e-14);  // a fractional order is charged at its ceiling
  EXPECT_LT(rdp[0], e(2) / 10) << "sampling amplified nothing";
}

TEST(DistributedDiscreteGaussian, SubsampledBoundIsAboveTheExactSampledGaussian) {
  // With τ = 0 the unsampled mechanism is the Gaussian's; Zhu and Wang's bound
  // must then lie above Mironov et al.'s exact sampled Gaussian RDP (never
  // below: it is a bound). It is loosest at large z: 9.05 times the exact
  // value at q = 0.1, z = 5, α = 12, where its terms beyond the second keep
  // e^{(l−1)ε(l)} and the exact series has them nearly cancel.
  std::vector<double> orders;
  for (int a = 2; a <= 64; ++a) orders.push_back(a);
  double worst_ratio = 0;
  for (double q : {0.001, 0.01, 0.1, 0.5}) {
    for (double z : {0.8, 1.0, 2.0, 5.0}) {
      const auto bound = *SampledDistributedDiscreteGaussianRdp(q, Mechanism(z, 100), orders);
      const auto exact = *SampledGaussianRdp(q, z, orders);
      for (size_t i = 0; i < orders.size(); ++i) {
        EXPECT_GE(bound[i], exact[i] * (1 - 1e-9)) << "q " << q << " z " << z << " α " << orders[i];
        worst_ratio = std::max(worst_ratio, bound[i] / exact[i]);
      }
    }
  }
  EXPECT_LT(worst_ratio, 10);
}

TEST(DistributedDiscreteGaussian, AccountantComposesRoundsOfIt) {
  auto accountant = *Accountant::Create(1e-5);
  const auto per_round = *SampledDistributedDiscreteGaussianRdp(0.1, Mechanism(1, 100), accountant.orders());
  const Epsilon preview = *accountant.EpsilonAfterRdp(per_round);
  ASSERT_TRUE(accountant.AddRoundRdp(per_round).ok());
  EXPECT_EQ(accountant.Spent().epsilon, preview.epsilon);
  ASSERT_TRUE(accountant.AddRoundRdp(per_round).ok());
  std::vector<double> twice = per_round;
  for (double& value : twice) value *= 2;
  EXPECT_NEAR(accountant.Spent().epsilon, EpsilonFromRdp(accountant.orders(), twice, 1e-5)->epsilon, 1e-12);
  EXPECT_GT(accountant.Spent().epsilon, preview.epsilon);
  EXPECT_EQ(accountant.rounds(), 2);
  // Above central DP's ε at the same (q, z): the subsampling bound is looser.
  EXPECT_GT(accountant.Spent().epsilon, EpsilonAfterRounds(0.1, 1, 2, 1e-5)->epsilon);
  const std::vector<double> short_rdp = {1.0};
  EXPECT_EQ(accountant.AddRoundRdp(short_rdp).message(),
            fmt::format("privacy: 1 RDP values for {} orders", accountant.orders().size()));
  EXPECT_EQ(accountant.rounds(), 2);
}

TEST(DistributedDiscreteGaussian, BadInputRefusedInOneLine) {
  auto m = Mechanism(1, 10);
  m.site_variance = 0.2;
  EXPECT_EQ(DistributedDiscreteGaussianRdp(m, 2).status().message(),
            "privacy: discrete Gaussian site variance 0.2: must be finite and >= 1/4");
  m = Mechanism(1, 10);
  m.sites = 0;
  EXPECT_FALSE(DistributedDiscreteGaussianTau(m).ok());
  EXPECT_EQ(DistributedDiscreteGaussianRdp(Mechanism(1, 10), 1).status().message(),
            "privacy: order 1: must be finite and > 1");
  const std::vector<double> orders = {2};
  EXPECT_EQ(SampledDistributedDiscreteGaussianRdp(1.5, Mechanism(1, 10), orders).status().message(),
            "privacy: sampling rate q = 1.5: must be in [0, 1]");
}

}  // namespace
}  // namespace estuary::privacy
