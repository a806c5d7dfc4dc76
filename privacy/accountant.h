// The privacy accountant of DP-FedAvg: how much (ε, δ) differential privacy a
// run of rounds has spent, where every round samples each site independently
// with probability q (Poisson sampling) and adds Gaussian noise of standard
// deviation z · S to a sum whose sensitivity is S (z: the noise multiplier).
//
// It works in Rényi differential privacy (RDP). One round is the sampled
// Gaussian mechanism, whose RDP at order α is (Mironov, Talwar and Zhang 2019,
// "Rényi Differential Privacy of the Sampled Gaussian Mechanism")
//
//   ε_round(α) = log A_α / (α − 1),   A_α = E_{x~N(0,z²)} [((1−q) + q·e^{(2x−1)/(2z²)})^α]
//
// computed in log space: for integer α by the binomial expansion, for
// fractional α by the paper's two series (split where the mixture's two terms
// are equal). q = 0 gives 0; q = 1 gives the Gaussian mechanism's α/(2z²).
// Integer orders keep full relative precision however close A_α is to 1 (the
// sum is formed as A_α − 1); the fractional series is accurate to about 1e-16
// in log A_α, so relatively less where A_α − 1 is tiny (q = 0.001, z = 5:
// ~1e-8), which changes ε by no more than 1e-16 per round.
// RDP adds over rounds, so T rounds spend T · ε_round(α) at every order; the
// accountant keeps that sum at each order of a grid and converts it to ε at a
// given δ, minimising over the grid and reporting the order that won:
//
//   kTight    ε = RDP(α) + log((α−1)/α) − (log δ + log α)/(α − 1)
//             (Canonne, Kamath and Steinke 2020, Prop. 12; Balle et al. 2020,
//             Thm. 21; what current accountants use)
//   kClassic  ε = RDP(α) + log(1/δ)/(α − 1)
//             (Mironov 2017, Prop. 3; what TF Privacy's tutorials and the
//             moments accountant of Abadi et al. 2016 reported)
//
// Both are valid bounds; kTight is never larger for α > 1 and is the default.
//
//   ESTUARY_ASSIGN_OR_RETURN(auto accountant, privacy::Accountant::Create(1e-5));
//   ESTUARY_ASSIGN_OR_RETURN(auto next, accountant.EpsilonAfter(q, z));
//   if (next.epsilon > budget) stop before the round;        // --dp-max-epsilon
//   ESTUARY_RETURN_IF_ERROR(accountant.AddRounds(q, z));     // the round ran
//   accountant.Spent().epsilon                               // the round log's ε
//
// Every function checks its inputs and returns a one-line InvalidArgument for
// q outside [0, 1], z not finite and > 0, δ outside (0, 1), an order not > 1,
// a negative round count or a NaN anywhere.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "base/status.h"

namespace estuary::privacy {

enum class Conversion { kTight, kClassic };

// The grid of orders ε is minimised over: 1.1, 1.2, …, 10.9, 11, 12, …, 63,
// 64, 128, 256, 512 (the grid of TF Privacy and dp_accounting, plus 64).
const std::vector<double>& DefaultOrders();

// RDP of one round of the sampled Gaussian mechanism at one order α > 1.
Result<double> SampledGaussianRdp(double q, double z, double order);
// The same at every order of `orders`.
Result<std::vector<double>> SampledGaussianRdp(double q, double z, std::span<const double> orders);

// (ε, δ) from RDP values, one per order: the smallest ε over the orders (never
// below 0), and the order that gave it. An RDP of 0 at every order (q = 0, or no
// round yet) is ε = 0: the output does not depend on the data.
struct Epsilon {
  double epsilon = 0;
  double order = 0;
};
Result<Epsilon> EpsilonFromRdp(std::span<const double> orders, std::span<const double> rdp, double delta,
                               Conversion conversion = Conversion::kTight);

// ε after `rounds` rounds of (q, z) at δ.
Result<Epsilon> EpsilonAfterRounds(double q, double z, int64_t rounds, double delta,
                                   Conversion conversion = Conversion::kTight,
                                   std::span<const double> orders = DefaultOrders());

// What MaxRounds returns when no number of rounds can exceed the budget (q = 0).
inline constexpr int64_t kUnboundedRounds = std::numeric_limits<int64_t>::max();

// The largest T ≥ 0 with EpsilonAfterRounds(q, z, T, δ) ≤ epsilon_budget
// (0 if not even one round fits). epsilon_budget must be ≥ 0.
Result<int64_t> MaxRounds(double q, double z, double delta, double epsilon_budget,
                          Conversion conversion = Conversion::kTight,
                          std::span<const double> orders = DefaultOrders());

// The running account of one federation: RDP summed over the rounds that ran,
// at a fixed δ, conversion and order grid. Rounds may differ in q and z.
class Accountant {
 public:
  static Result<Accountant> Create(double delta, Conversion conversion = Conversion::kTight,
                                   std::vector<double> orders = DefaultOrders());

  // Records `rounds` more rounds of (q, z).
  Status AddRounds(double q, double z, int64_t rounds = 1);
  // ε spent so far (0 before any round).
  Epsilon Spent() const;
  // ε if `rounds` more rounds of (q, z) ran; records nothing.
  Result<Epsilon> EpsilonAfter(double q, double z, int64_t rounds = 1) const;
  // How many more rounds of (q, z) keep ε ≤ epsilon_budget (kUnboundedRounds when q = 0).
  Result<int64_t> RoundsWithin(double q, double z, double epsilon_budget) const;

  // The same for a round of another mechanism, given as its RDP at each of
  // orders() (e.g. privacy/distributed_dp.h's): one value >= 0 per order.
  Status AddRoundRdp(std::span<const double> per_round);
  Result<Epsilon> EpsilonAfterRdp(std::span<const double> per_round) const;

  int64_t rounds() const { return rounds_; }
  double delta() const { return delta_; }
  const std::vector<double>& orders() const { return orders_; }
  const std::vector<double>& rdp() const { return rdp_; }  // the sum so far, per order

 private:
  Accountant(double delta, Conversion conversion, std::vector<double> orders);

  double delta_;
  Conversion conversion_;
  std::vector<double> orders_;
  std::vector<double> rdp_;
  int64_t rounds_ = 0;
};

}  // namespace estuary::privacy
