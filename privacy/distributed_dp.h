// The Rényi DP of one round of distributed DP under secure aggregation: each
// of n sites adds N_Z(0, σ²) (the discrete Gaussian, secagg/discrete_gaussian.h)
// to its integer update, and only the sum is released, so the noise on it is a
// sum of n discrete Gaussians — not itself a discrete Gaussian, but close to
// N_Z(0, nσ²).
//
// Kairouz, Liu and Steinke 2021 ("The Distributed Discrete Gaussian Mechanism
// for Federated Learning with Secure Aggregation"), Theorem 1 / Proposition 14:
// with Δ₂, Δ₁ the L2 and L1 sensitivities of one site's integer vector in Z^d,
// σ ≥ 1/2 and
//   τ = 10 · Σ_{k=1}^{n−1} exp(−2π²σ² · k/(k+1)),
// the sum satisfies, at every order α > 1,
//   ε(α) = min( α/2 · Δ₂²/(nσ²) + τ·d,
//               α/2 · (Δ₂²/(nσ²) + 2τ·Δ₁/(√n σ) + τ²·d),
//               α/2 · (Δ₂/(√n σ) + τ·√d)² ).
// With τ = 0 (σ large: τ underflows once 2π²σ²/2 > 745, i.e. σ > 8.7) this
// is the Gaussian mechanism's α/(2z²) with z = √n σ / Δ₂.
//
// The plan (PlanDistributedDpShares) is how the sites of one round calibrate their
// shares, shared by estuary-sim --secagg --dp distributed and estuary-server
// serve --secagg --dp distributed: one site's update, clipped to C and
// quantised with scale s into the ring Z/2^b, has L2 norm at most
// Δ = s·C + √d + 1 (stochastic rounding moves each element by under one step;
// the 1 covers the clip's float rounding); each share has variance
// V = ⌈(z·Δ)² / m⌉ with m = ⌈survivors · n⌉ (n the sites sampled, or the
// expected q·N under Poisson sampling), so any m shares sum to at least the
// target (z·Δ)², and the server must refuse to unmask fewer than m inputs.
// s is the largest scale with n·(s·C + 1) + 10·√(n·V) ≤ 2^(b−1) − 1 (n, or
// max_sites where given): the sum wraps only where an element's noise passes
// ten standard deviations, and V stays within the sampler's 2^52.
//
// Poisson sampling with rate q < 1 (each site joins a round with probability
// q): the Rényi DP of a subsampled mechanism given only the mechanism's own
// ε(·) — Zhu and Wang 2019 ("Poisson Subsampled Rényi Differential Privacy",
// ICML), the general upper bound (their Theorem 5 in the proceedings), for
// integer α ≥ 2:
//   ε_q(α) ≤ 1/(α−1) · log( (1−q)^(α−1) (1 + (α−1) q)
//                           + C(α,2) q² (1−q)^(α−2) e^{ε(2)}
//                           + 3 Σ_{l=3}^{α} C(α,l) q^l (1−q)^(α−l) e^{(l−1) ε(l)} ),
// and never more than ε(α) itself (subsampling cannot hurt). It is looser
// than the sampled Gaussian's exact series (privacy/accountant.h), which holds
// for the continuous Gaussian only; ε of distributed DP is therefore somewhat
// above central DP's at the same z. A fractional order α is charged the
// bound at ⌈α⌉ (RDP is non-decreasing in α). This is what the accounting code
// of the paper's authors (google-research/federated, distributed_dp) does.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/status.h"

namespace estuary::privacy {

// The largest share variance the sampler takes (secagg::kMaxDiscreteGaussianVariance).
inline constexpr uint64_t kMaxShareVariance = uint64_t(1) << 52;

struct DistributedDpOptions {
  double noise_multiplier = 0;  // z; 0: off
  double clip = 1;              // C
  double survivors = 1;         // the fraction of the sampled sites the noise is calibrated for, (0, 1]
  double denominator = 0;       // the mean's fixed denominator (sites expected a round), > 0
  // Poisson sampling: the plan is the run's, not the round's draw's —
  // survivors is a fraction of expected_sites (q·N), and the ring has room
  // for max_sites; a round that draws more must be refused. 0: the round's n.
  double expected_sites = 0;
  uint32_t max_sites = 0;
};

// What the sites of one round of n use: the scale, each share's variance,
// the sensitivity it covers, and the fewest inputs the server may unmask.
struct DistributedDpPlan {
  double scale = 0;
  uint64_t site_variance = 0;
  double sensitivity = 0;
  uint32_t min_included = 0;
  uint64_t dimension = 0;
};
// Fails (one line, naming --secagg-bits, --dp-clip and --dp-noise-multiplier)
// when the ring leaves no room for a scale of at least 1.
Result<DistributedDpPlan> PlanDistributedDpShares(const DistributedDpOptions& dp, int bits, uint32_t sites,
                                                  uint64_t dimension);

struct DistributedDiscreteGaussian {
  double l2_sensitivity = 0;  // Δ₂ > 0 in the integer domain
  double l1_sensitivity = 0;  // Δ₁; 0: Δ₂ · min(√d, Δ₂) (integer vectors: ‖x‖₁ ≤ ‖x‖₂²)
  double site_variance = 0;   // σ² of each site's share, >= 1/4
  int64_t sites = 0;          // n, the sites whose noise is in the sum, >= 1
  int64_t dimension = 0;      // d >= 1
};

// τ of the theorem above.
Result<double> DistributedDiscreteGaussianTau(const DistributedDiscreteGaussian& mechanism);

// ε(α) of one unsampled release, at one order α > 1.
Result<double> DistributedDiscreteGaussianRdp(const DistributedDiscreteGaussian& mechanism, double order);

// One round with Poisson sampling rate q ∈ [0, 1], at every order: q = 1 is
// the mechanism's own ε(α), q = 0 is 0.
Result<std::vector<double>> SampledDistributedDiscreteGaussianRdp(double q,
                                                                  const DistributedDiscreteGaussian& mechanism,
                                                                  std::span<const double> orders);

// The Rényi DP of one round (sampling rate q) whose sum holds `included`
// shares of the plan's noise, at each of `orders`.
Result<std::vector<double>> DistributedDpRoundRdp(const DistributedDpPlan& plan, uint32_t included, double q,
                                                  std::span<const double> orders);

}  // namespace estuary::privacy
