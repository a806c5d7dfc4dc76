#include "privacy/accountant.h"

#include <algorithm>
#include <cmath>

namespace estuary::privacy {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// log(e^a + e^b), exact when either is -inf.
double LogAdd(double a, double b) {
  if (a == -kInf) return b;
  if (b == -kInf) return a;
  const double hi = std::max(a, b), lo = std::min(a, b);
  return hi + std::log1p(std::exp(lo - hi));
}

// log(e^a − e^b) for a ≥ b.
double LogSub(double a, double b) {
  if (b == -kInf) return a;
  if (b >= a) return -kInf;
  return a + std::log1p(-std::exp(b - a));
}

// log(e^x − 1) for x > 0, without overflow for large x.
double LogExpm1(double x) { return x > 30 ? x + std::log1p(-std::exp(-x)) : std::log(std::expm1(x)); }

// log(erfc(x)), finite far into the tail where erfc underflows: beyond x = 25
// the asymptotic series e^{−x²}/(x√π) · (1 − 1/(2x²) + 3/(4x⁴) − …), whose
// first omitted term there is below 1e-13 relative.
double LogErfc(double x) {
  if (x < 25) return std::log(std::erfc(x));
  const double u = 1 / (2 * x * x);
  double sum = 1, term = 1;
  for (int k = 1; k <= 5; ++k) {
    term *= -(2 * k - 1) * u;
    sum += term;
  }
  return -x * x - std::log(x) - 0.5 * std::log(M_PI) + std::log(sum);
}

// log A_α for integer α ≥ 2, 0 < q < 1. The binomial expansion
//   A_α = Σ_k C(α,k) (1−q)^{α−k} q^k e^{(k²−k)/(2z²)}
// has weights summing to 1, so A_α − 1 = Σ_{k≥2} C(α,k) (1−q)^{α−k} q^k (e^{(k²−k)/(2z²)} − 1),
// a sum of positive terms: summed in log space, it keeps full relative precision
// even when A_α is within 1e-12 of 1 (small q).
double LogAInteger(double q, double z, int64_t alpha) {
  const double log_q = std::log(q), log_1mq = std::log1p(-q);
  const double lgamma_alpha1 = std::lgamma(static_cast<double>(alpha) + 1);
  double log_a_minus_1 = -kInf;
  for (int64_t k = 2; k <= alpha; ++k) {
    const double kd = static_cast<double>(k);
    const double log_binom = lgamma_alpha1 - std::lgamma(kd + 1) - std::lgamma(static_cast<double>(alpha - k) + 1);
    const double log_term = log_binom + static_cast<double>(alpha - k) * log_1mq + kd * log_q +
                            LogExpm1((kd * kd - kd) / (2 * z * z));
    log_a_minus_1 = LogAdd(log_a_minus_1, log_term);
  }
  // log A = log(1 + e^L).
  return LogAdd(0, log_a_minus_1);
}

// log A_α for fractional α > 1, 0 < q < 1: the two series of Mironov, Talwar
// and Zhang (2019, Sec. 3.3). Split the integral at x₀ = z² log(1/q − 1) + 1/2,
// where q·e^{(2x−1)/(2z²)} = 1 − q; below it expand (1−q + q·r)^α in powers of
// q·r/(1−q), above it in powers of (1−q)/(q·r). Term i of each is
//   below: C(α,i) q^i (1−q)^{α−i} e^{(i²−i)/(2z²)} · ½ erfc((i − x₀)/(√2 z))
//   above: C(α,i) q^{α−i} (1−q)^i e^{(j²−j)/(2z²)} · ½ erfc((x₀ − j)/(√2 z)),  j = α − i
// The generalized binomial C(α,i) is positive up to i = ⌊α⌋ + 1 and then
// alternates in sign; positive and negative terms are summed apart in log
// space and subtracted at the end. The terms fall off like i^{−α−2}, and past
// i = α + 1 each series alternates, so stopping once a term is below 1e-15 of
// the sum bounds the truncation error by that term.
Result<double> LogAFractional(double q, double z, double alpha) {
  const double log_q = std::log(q), log_1mq = std::log1p(-q);
  const double x0 = z * z * std::log(1 / q - 1) + 0.5;
  const double log_half = std::log(0.5), sqrt2z = std::sqrt(2.0) * z;
  double pos = -kInf, neg = -kInf;
  double log_binom = 0;  // log |C(α, 0)|
  bool negative = false;
  constexpr int64_t kMaxTerms = 10'000'000;
  const double kLogTolerance = std::log(1e-15);
  for (int64_t i = 0; i < kMaxTerms; ++i) {
    if (i > 0) {
      const double factor = (alpha - static_cast<double>(i) + 1) / static_cast<double>(i);
      log_binom += std::log(std::fabs(factor));
      if (factor < 0) negative = !negative;
    }
    const double id = static_cast<double>(i), j = alpha - id;
    const double below = log_binom + id * log_q + j * log_1mq + (id * id - id) / (2 * z * z) + log_half +
                         LogErfc((id - x0) / sqrt2z);
    const double above = log_binom + j * log_q + id * log_1mq + (j * j - j) / (2 * z * z) + log_half +
                         LogErfc((x0 - j) / sqrt2z);
    const double term = LogAdd(below, above);
    if (negative) {
      neg = LogAdd(neg, term);
    } else {
      pos = LogAdd(pos, term);
    }
    if (id > alpha + 1 && term < LogSub(pos, neg) + kLogTolerance) {
      if (neg >= pos) return Internal("privacy: the fractional series at order {} lost all precision", alpha);
      return LogSub(pos, neg);
    }
  }
  return Internal("privacy: the fractional series at order {} (q = {}, z = {}) did not converge", alpha, q, z);
}

Status CheckSampling(double q, double z) {
  if (!(q >= 0 && q <= 1)) return InvalidArgument("privacy: sampling rate q = {}: must be in [0, 1]", q);
  if (!(z > 0 && std::isfinite(z))) return InvalidArgument("privacy: noise multiplier z = {}: must be finite and > 0", z);
  return Status::Ok();
}

Status CheckDelta(double delta) {
  if (!(delta > 0 && delta < 1)) return InvalidArgument("privacy: delta = {}: must be in (0, 1)", delta);
  return Status::Ok();
}

Status CheckOrders(std::span<const double> orders) {
  if (orders.empty()) return InvalidArgument("privacy: no orders to minimise over");
  for (double order : orders) {
    if (!(order > 1 && std::isfinite(order))) return InvalidArgument("privacy: order {}: must be finite and > 1", order);
  }
  return Status::Ok();
}

// The constant the conversion adds to RDP(α) to give ε at order α.
double ConversionTerm(double order, double delta, Conversion conversion) {
  if (conversion == Conversion::kClassic) return -std::log(delta) / (order - 1);
  return std::log((order - 1) / order) - (std::log(delta) + std::log(order)) / (order - 1);
}

// ε at the rdp values prior + rounds · per_round (per_round may be empty: none).
Epsilon EpsilonOf(std::span<const double> orders, std::span<const double> prior, std::span<const double> per_round,
                  int64_t rounds, double delta, Conversion conversion) {
  bool all_zero = true;
  Epsilon best{kInf, orders[0]};
  for (size_t i = 0; i < orders.size(); ++i) {
    const double rdp = prior[i] + (per_round.empty() ? 0.0 : static_cast<double>(rounds) * per_round[i]);
    if (rdp != 0) all_zero = false;
    const double epsilon = rdp + ConversionTerm(orders[i], delta, conversion);
    if (epsilon < best.epsilon) best = {epsilon, orders[i]};
  }
  if (all_zero) return {0, best.order};
  best.epsilon = std::max(0.0, best.epsilon);
  return best;
}

// The largest T with ε(prior + T · per_round) ≤ budget.
int64_t MaxRoundsFrom(std::span<const double> orders, std::span<const double> prior,
                      std::span<const double> per_round, double delta, double budget, Conversion conversion) {
  bool any_positive = false;
  double best = -1;
  for (size_t i = 0; i < orders.size(); ++i) {
    if (per_round[i] <= 0) continue;
    any_positive = true;
    const double room = budget - prior[i] - ConversionTerm(orders[i], delta, conversion);
    if (room >= 0) best = std::max(best, std::floor(room / per_round[i]));
  }
  if (!any_positive) return kUnboundedRounds;
  if (best >= 9e18) return kUnboundedRounds;
  int64_t t = best < 0 ? 0 : static_cast<int64_t>(best);
  // The closed form can be one off where floating point rounds; settle it on ε itself.
  auto fits = [&](int64_t rounds) {
    return EpsilonOf(orders, prior, per_round, rounds, delta, conversion).epsilon <= budget;
  };
  while (t > 0 && !fits(t)) --t;
  while (fits(t + 1)) ++t;
  return t;
}

}  // namespace

const std::vector<double>& DefaultOrders() {
  static const std::vector<double> orders = [] {
    std::vector<double> o;
    for (int x = 1; x < 100; ++x) o.push_back(1 + x / 10.0);
    for (int a = 11; a <= 64; ++a) o.push_back(a);
    for (double a : {128.0, 256.0, 512.0}) o.push_back(a);
    return o;
  }();
  return orders;
}

Result<double> SampledGaussianRdp(double q, double z, double order) {
  ESTUARY_RETURN_IF_ERROR(CheckSampling(q, z));
  const double one[] = {order};
  ESTUARY_RETURN_IF_ERROR(CheckOrders(one));
  if (q == 0) return 0.0;
  if (q == 1) return order / (2 * z * z);
  double log_a;
  if (order == std::floor(order) && order <= 1e6) {
    log_a = LogAInteger(q, z, static_cast<int64_t>(order));
  } else {
    ESTUARY_ASSIGN_OR_RETURN(log_a, LogAFractional(q, z, order));
  }
  return log_a / (order - 1);
}

Result<std::vector<double>> SampledGaussianRdp(double q, double z, std::span<const double> orders) {
  ESTUARY_RETURN_IF_ERROR(CheckSampling(q, z));
  ESTUARY_RETURN_IF_ERROR(CheckOrders(orders));
  std::vector<double> rdp;
  rdp.reserve(orders.size());
  for (double order : orders) {
    ESTUARY_ASSIGN_OR_RETURN(double value, SampledGaussianRdp(q, z, order));
    rdp.push_back(value);
  }
  return rdp;
}

Result<Epsilon> EpsilonFromRdp(std::span<const double> orders, std::span<const double> rdp, double delta,
                               Conversion conversion) {
  ESTUARY_RETURN_IF_ERROR(CheckOrders(orders));
  ESTUARY_RETURN_IF_ERROR(CheckDelta(delta));
  if (rdp.size() != orders.size()) {
    return InvalidArgument("privacy: {} RDP values for {} orders", rdp.size(), orders.size());
  }
  for (double value : rdp) {
    if (!(value >= 0)) return InvalidArgument("privacy: RDP value {}: must be >= 0", value);
  }
  return EpsilonOf(orders, rdp, {}, 0, delta, conversion);
}

Result<Epsilon> EpsilonAfterRounds(double q, double z, int64_t rounds, double delta, Conversion conversion,
                                   std::span<const double> orders) {
  ESTUARY_RETURN_IF_ERROR(CheckDelta(delta));
  if (rounds < 0) return InvalidArgument("privacy: rounds = {}: must be >= 0", rounds);
  ESTUARY_ASSIGN_OR_RETURN(auto per_round, SampledGaussianRdp(q, z, orders));
  const std::vector<double> prior(orders.size(), 0.0);
  return EpsilonOf(orders, prior, per_round, rounds, delta, conversion);
}

Result<int64_t> MaxRounds(double q, double z, double delta, double epsilon_budget, Conversion conversion,
                          std::span<const double> orders) {
  ESTUARY_RETURN_IF_ERROR(CheckDelta(delta));
  if (!(epsilon_budget >= 0 && std::isfinite(epsilon_budget))) {
    return InvalidArgument("privacy: epsilon budget {}: must be finite and >= 0", epsilon_budget);
  }
  ESTUARY_ASSIGN_OR_RETURN(auto per_round, SampledGaussianRdp(q, z, orders));
  const std::vector<double> prior(orders.size(), 0.0);
  return MaxRoundsFrom(orders, prior, per_round, delta, epsilon_budget, conversion);
}

Accountant::Accountant(double delta, Conversion conversion, std::vector<double> orders)
    : delta_(delta), conversion_(conversion), orders_(std::move(orders)), rdp_(orders_.size(), 0.0) {}

Result<Accountant> Accountant::Create(double delta, Conversion conversion, std::vector<double> orders) {
  ESTUARY_RETURN_IF_ERROR(CheckDelta(delta));
  ESTUARY_RETURN_IF_ERROR(CheckOrders(orders));
  return Accountant(delta, conversion, std::move(orders));
}

Status Accountant::AddRounds(double q, double z, int64_t rounds) {
  if (rounds < 0) return InvalidArgument("privacy: rounds = {}: must be >= 0", rounds);
  ESTUARY_ASSIGN_OR_RETURN(auto per_round, SampledGaussianRdp(q, z, orders_));
  for (size_t i = 0; i < orders_.size(); ++i) rdp_[i] += static_cast<double>(rounds) * per_round[i];
  rounds_ += rounds;
  return Status::Ok();
}

Epsilon Accountant::Spent() const { return EpsilonOf(orders_, rdp_, {}, 0, delta_, conversion_); }

Result<Epsilon> Accountant::EpsilonAfter(double q, double z, int64_t rounds) const {
  if (rounds < 0) return InvalidArgument("privacy: rounds = {}: must be >= 0", rounds);
  ESTUARY_ASSIGN_OR_RETURN(auto per_round, SampledGaussianRdp(q, z, orders_));
  return EpsilonOf(orders_, rdp_, per_round, rounds, delta_, conversion_);
}

Result<int64_t> Accountant::RoundsWithin(double q, double z, double epsilon_budget) const {
  if (!(epsilon_budget >= 0 && std::isfinite(epsilon_budget))) {
    return InvalidArgument("privacy: epsilon budget {}: must be finite and >= 0", epsilon_budget);
  }
  ESTUARY_ASSIGN_OR_RETURN(auto per_round, SampledGaussianRdp(q, z, orders_));
  return MaxRoundsFrom(orders_, rdp_, per_round, delta_, epsilon_budget, conversion_);
}

static Status CheckRoundRdp(std::span<const double> per_round, size_t orders) {
  if (per_round.size() != orders) {
    return InvalidArgument("privacy: {} RDP values for {} orders", per_round.size(), orders);
  }
  for (double value : per_round) {
    if (!(value >= 0)) return InvalidArgument("privacy: RDP value {}: must be >= 0", value);
  }
  return Status::Ok();
}

Status Accountant::AddRoundRdp(std::span<const double> per_round) {
  ESTUARY_RETURN_IF_ERROR(CheckRoundRdp(per_round, orders_.size()));
  for (size_t i = 0; i < orders_.size(); ++i) rdp_[i] += per_round[i];
  ++rounds_;
  return Status::Ok();
}

Result<Epsilon> Accountant::EpsilonAfterRdp(std::span<const double> per_round) const {
  ESTUARY_RETURN_IF_ERROR(CheckRoundRdp(per_round, orders_.size()));
  return EpsilonOf(orders_, rdp_, per_round, 1, delta_, conversion_);
}

}  // namespace estuary::privacy
