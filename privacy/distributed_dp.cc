#include "privacy/distributed_dp.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "privacy/poisson_plan.h"

namespace estuary::privacy {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

Status CheckMechanism(const DistributedDiscreteGaussian& m) {
  if (!(std::isfinite(m.l2_sensitivity) && m.l2_sensitivity > 0)) {
    return InvalidArgument("privacy: discrete Gaussian L2 sensitivity {}: must be finite and > 0", m.l2_sensitivity);
  }
  if (!(std::isfinite(m.l1_sensitivity) && m.l1_sensitivity >= 0)) {
    return InvalidArgument("privacy: discrete Gaussian L1 sensitivity {}: must be finite and >= 0", m.l1_sensitivity);
  }
  if (!(std::isfinite(m.site_variance) && m.site_variance >= 0.25)) {
    return InvalidArgument("privacy: discrete Gaussian site variance {}: must be finite and >= 1/4", m.site_variance);
  }
  if (m.sites < 1) return InvalidArgument("privacy: discrete Gaussian sum of {} sites: must be >= 1", m.sites);
  if (m.dimension < 1) return InvalidArgument("privacy: discrete Gaussian dimension {}: must be >= 1", m.dimension);
  return Status::Ok();
}

Status CheckOrder(double order) {
  if (!(std::isfinite(order) && order > 1)) return InvalidArgument("privacy: order {}: must be finite and > 1", order);
  return Status::Ok();
}

double LogAdd(double a, double b) {
  if (a == -kInf) return b;
  if (b == -kInf) return a;
  const double hi = std::max(a, b), lo = std::min(a, b);
  return hi + std::log1p(std::exp(lo - hi));
}

double LogBinomial(double n, double k) { return std::lgamma(n + 1) - std::lgamma(k + 1) - std::lgamma(n - k + 1); }

// ε(α) without checks: Proposition 14's three terms, the least.
double Rdp(const DistributedDiscreteGaussian& m, double tau, double order) {
  const double d = double(m.dimension);
  const double sum_stddev = std::sqrt(double(m.sites) * m.site_variance);
  const double l2 = m.l2_sensitivity / sum_stddev;
  const double l1_sensitivity =
      m.l1_sensitivity > 0 ? m.l1_sensitivity : m.l2_sensitivity * std::min(std::sqrt(d), m.l2_sensitivity);
  const double l1 = l1_sensitivity / sum_stddev;
  const double first = order / 2 * l2 * l2 + tau * d;
  const double second = order / 2 * (l2 * l2 + 2 * l1 * tau + tau * tau * d);
  const double third = order / 2 * (l2 + tau * std::sqrt(d)) * (l2 + tau * std::sqrt(d));
  return std::min({first, second, third});
}

// Zhu and Wang's general bound at integer α >= 2, for 0 < q < 1.
double SubsampledRdp(double q, int64_t order, const DistributedDiscreteGaussian& m, double tau) {
  const double a = double(order);
  const double log_q = std::log(q), log_1mq = std::log1p(-q);
  double log_sum = (a - 1) * log_1mq + std::log1p((a - 1) * q);
  log_sum = LogAdd(log_sum, LogBinomial(a, 2) + 2 * log_q + (a - 2) * log_1mq + Rdp(m, tau, 2));
  for (int64_t l = 3; l <= order; ++l) {
    const double x = double(l);
    log_sum = LogAdd(log_sum, std::log(3.0) + LogBinomial(a, x) + x * log_q + (a - x) * log_1mq +
                                  (x - 1) * Rdp(m, tau, x));
  }
  return log_sum / (a - 1);
}

}  // namespace

Result<double> DistributedDiscreteGaussianTau(const DistributedDiscreteGaussian& m) {
  ESTUARY_RETURN_IF_ERROR(CheckMechanism(m));
  double tau = 0;
  for (int64_t k = 1; k < m.sites; ++k) {
    const double term = std::exp(-2 * M_PI * M_PI * m.site_variance * double(k) / double(k + 1));
    if (term == 0) break;  // k/(k+1) grows with k: every later term underflows too
    tau += term;
  }
  return 10 * tau;
}

Result<double> DistributedDiscreteGaussianRdp(const DistributedDiscreteGaussian& m, double order) {
  ESTUARY_RETURN_IF_ERROR(CheckOrder(order));
  ESTUARY_ASSIGN_OR_RETURN(const double tau, DistributedDiscreteGaussianTau(m));
  return Rdp(m, tau, order);
}

Result<std::vector<double>> SampledDistributedDiscreteGaussianRdp(double q, const DistributedDiscreteGaussian& m,
                                                                  std::span<const double> orders) {
  if (!(q >= 0 && q <= 1)) return InvalidArgument("privacy: sampling rate q = {}: must be in [0, 1]", q);
  if (orders.empty()) return InvalidArgument("privacy: no orders");
  for (double order : orders) ESTUARY_RETURN_IF_ERROR(CheckOrder(order));
  ESTUARY_ASSIGN_OR_RETURN(const double tau, DistributedDiscreteGaussianTau(m));
  std::vector<double> rdp;
  rdp.reserve(orders.size());
  for (double order : orders) {
    if (q == 0) {
      rdp.push_back(0);
    } else if (q == 1) {
      rdp.push_back(Rdp(m, tau, order));
    } else {
      const double whole = std::ceil(order);
      rdp.push_back(std::min(Rdp(m, tau, order), SubsampledRdp(q, int64_t(whole), m, tau)));
    }
  }
  return rdp;
}

uint32_t PoissonPlannedMaximum(uint32_t sites, double q) {
  const double expected = q * sites;
  const double most = std::ceil(expected + 6 * std::sqrt(expected * (1 - q))) + 1;
  return uint32_t(std::min(most, double(sites)));
}

Result<DistributedDpPlan> PlanDistributedDpShares(const DistributedDpOptions& dp, int bits, uint32_t sites,
                                                  uint64_t dimension) {
  const double z = dp.noise_multiplier, clip = dp.clip, n = dp.max_sites > 0 ? dp.max_sites : sites;
  if (!(std::isfinite(z) && z > 0)) return InvalidArgument("--dp-noise-multiplier {}: must be finite and > 0", z);
  if (!(std::isfinite(clip) && clip > 0)) return InvalidArgument("--dp-clip {}: must be finite and > 0", clip);
  if (!(dp.survivors > 0 && dp.survivors <= 1)) {
    return InvalidArgument("--dp-survivors {}: must be in (0, 1]", dp.survivors);
  }
  if (bits < 2 || bits > 64 || sites < 1 || dimension < 1) {
    return InvalidArgument("a ring of {} bits, {} sites, {} elements: no plan", bits, sites, dimension);
  }
  DistributedDpPlan plan;
  plan.min_included = uint32_t(std::ceil(dp.survivors * (dp.expected_sites > 0 ? dp.expected_sites : n) - 1e-9));
  const double m = std::max<uint32_t>(plan.min_included, 1);
  const double slack = std::sqrt(double(dimension)) + 1;  // Δ = s·C + slack
  const double limit = std::ldexp(1.0, bits - 1) - 1;
  // n(sC + 1) + 10 √(nV) <= limit with √(nV) <= z·Δ·√(n/m) + √n.
  const double r = std::sqrt(n / m);
  double scale = (limit - n - 10 * std::sqrt(n) - 10 * z * r * slack) / (clip * (n + 10 * z * r));
  scale = std::min(scale, (std::sqrt(m) * std::ldexp(1.0, 26) / z - slack) / clip);  // V <= 2^52
  scale = std::floor(scale);
  if (!(scale >= 1)) {
    return InvalidArgument("--secagg-bits {} leaves no room for {} sites at --dp-clip {} and --dp-noise-multiplier {} "
                           "(scale {} < 1)",
                           bits, sites, clip, z, scale);
  }
  plan.scale = scale;
  plan.dimension = dimension;
  plan.sensitivity = scale * clip + slack;
  plan.site_variance = uint64_t(std::max(1.0, std::ceil(z * z * plan.sensitivity * plan.sensitivity / m)));
  const double worst = n * (scale * clip + 1) + 10 * std::sqrt(n * double(plan.site_variance));
  if (plan.site_variance > kMaxShareVariance || worst > limit) {
    return Internal("scale {} gives variance {} and a worst sum of {} in {} bits", scale, plan.site_variance, worst,
                    bits);
  }
  return plan;
}

Result<std::vector<double>> DistributedDpRoundRdp(const DistributedDpPlan& plan, uint32_t included, double q,
                                                  std::span<const double> orders) {
  const DistributedDiscreteGaussian mechanism{.l2_sensitivity = plan.sensitivity,
                                              .site_variance = double(plan.site_variance),
                                              .sites = included,
                                              .dimension = int64_t(plan.dimension)};
  return SampledDistributedDiscreteGaussianRdp(q, mechanism, orders);
}

}  // namespace estuary::privacy
