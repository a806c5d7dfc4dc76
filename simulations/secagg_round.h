// One round's FedAvg through SecAgg+ in the simulator (estuary-sim --secagg):
// each sampled site's example-weighted full update is quantised, masked by
// its SecAggClient and summed by the SecAggServer (secagg/), with sites
// dropping out at a seeded random stage, and the server's sum dequantised
// into the weighted mean of the included sites' clipped updates.
//
// Quantisation (secagg/quantize.h): q_u = StochasticRound(w_u · s · clip_C(x_u))
// in Z/2^b with w_u the site's example count and the scale chosen as large as
// the ring allows for the round's sampled sites,
//   s = floor((2^(b−1) − 1 − n) / (C · W)),   W = Σ w over the n sampled sites,
// so the sum never wraps (CheckNoOverflow). Each element of the mean is then
// within n_included / (s · W_included) of the weighted mean of the clipped
// float updates: about n · C / 2^(b−1) when (nearly) all sampled sites are
// included (C = 100, b = 32, n = 10: 5e-7).
//
// Dropout: each sampled site, with probability `dropout`, stops at one of
// four stages chosen uniformly — before advertising its keys, after
// advertising, after sharing its keys, after sending its masked input (then
// its input is in the sum and only its unmasking answer is missing). The
// draws, the graph seed and the rounding seeds derive from the federation's
// seed and the round, so a run reproduces; the sites' keys and masks come
// from RAND_bytes and cancel exactly, so they do not change the result.
//
// Distributed DP (estuary-sim --dp distributed; docs/PRIVACY.md): with
// options.dp.noise_multiplier z > 0 every site weighs its update 1 (not its
// examples), clips it to dp.clip C, quantises it with a scale s and adds its
// share of discrete Gaussian noise, N_Z(0, V), to the ring elements before
// masking (secagg/discrete_gaussian.h). One site's quantised update has L2
// norm at most Δ = s·C + √d + 1 (stochastic rounding moves each of the d
// elements by under one step; the 1 covers the clip's float rounding), and
// the shares are calibrated so that m = ⌈dp.survivors · n⌉ of them sum to
// the target: V = ⌈(z·Δ)² / m⌉. The server refuses to unmask a sum of fewer
// than m inputs (the round ends the run with one line), so the noise in
// anything released is at least z·Δ; the accountant charges each round with
// the number of inputs actually summed (privacy/distributed_dp.h). The mean
// is the signed sum / (s · dp.denominator), a fixed denominator as in
// DP-FedAvg. s is the largest that keeps n·(s·C + 1) + 10·√(n·V) within
// 2^(b−1) − 1, so the sum wraps only where one element's noise passes ten
// standard deviations (under 1e-16 a round for d = 2·10^5), and V within the
// sampler's 2^52.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "aggregation/lora_strategy.h"
#include "base/status.h"
#include "privacy/accountant.h"
#include "privacy/distributed_dp.h"
#include "secagg/bytes.h"

namespace estuary::simulations {

// The plan of the sites' shares (privacy/distributed_dp.h), shared with the server.
using privacy::DistributedDpOptions;
using privacy::DistributedDpPlan;
using privacy::DistributedDpRoundRdp;
// privacy::PlanDistributedDpShares with the simulator's prefix on its refusals.
Result<DistributedDpPlan> PlanDistributedDp(const DistributedDpOptions& dp, int bits, uint32_t sites,
                                            uint64_t dimension);

struct SecAggOptions {
  int neighbours = 0;   // k; 0: secagg::DefaultDegree(n)
  int threshold = 0;    // t; 0: secagg::DefaultThreshold(k)
  int bits = 32;        // the ring Z/2^bits, 2..32
  double clip = 100;    // C: the L2 norm each update is clipped to before weighting
  double dropout = 0;   // per sampled site, in [0, 1)
  DistributedDpOptions dp;
};

// ε after one more round of `sites` sampled at rate q, charged as if only
// the fewest inputs the server may unmask were summed: what the budget stop
// (--dp-max-epsilon) asks before the round runs.
Result<privacy::Epsilon> DistributedDpPreview(const privacy::Accountant& accountant, const SecAggOptions& options,
                                              double q, uint32_t sites, uint64_t dimension);

// A LoRA federation under --secagg (naive and frozen-a merges, which need
// only the mean upload): the sites' uploads are factors, so what the protocol
// sums is how far each site moved them, upload − `values` (the global
// adapter's tensors in the upload layout), and the mean upload is `values`
// plus the mean movement. The clip and the quantisation bound then apply to
// the movement, as DP-FedAvg's clip does (aggregation/dp_fedavg.h).
struct SecAggLoraReference {
  std::vector<float> values;
};
Result<SecAggLoraReference> LoraReferenceOf(const aggregation::LoraStrategyOptions& lora,
                                            std::span<const float> global);

// The options, and the protocol they make for rounds of `sites` sites.
Status CheckSecAggOptions(const SecAggOptions& options, uint32_t sites);

struct SecAggSiteInput {
  std::span<const float> update;  // local − global
  double examples = 0;            // its weight, > 0
};

// Where a sampled site stops (the header's "Dropout"); kNone: it completes the protocol.
enum class SecAggDropStage { kNone, kBeforeAdvertise, kAfterAdvertise, kAfterShare, kAfterMaskedInput };
constexpr int kSecAggDropStages = 4;  // the stages above but kNone, in the report's order

struct SecAggRoundResult {
  std::vector<float> mean;        // the example-weighted mean of the included sites' clipped updates
  std::vector<size_t> included;   // indices into the inputs, ascending
  double included_weight = 0;     // Σ examples of the included sites
  uint32_t dropouts = 0;          // sites that stopped at some stage
  std::array<uint32_t, kSecAggDropStages> dropouts_by_stage{};  // of those, by SecAggDropStage − 1
  uint32_t clipped = 0;           // updates whose norm exceeded C
  uint64_t bytes_per_site = 0;    // mean over the sampled sites, sent + received
  double seconds = 0;
  double error_bound = 0;         // per element of `mean`
  int neighbours = 0, threshold = 0;
  std::vector<uint32_t> sum;      // the server's unmasked sum in Z/2^b
  DistributedDpPlan dp;           // under distributed DP: what the sites used
};

// The keys of site u's stochastic rounding and of its noise in a round, from
// the federation's seed: a simulation reproduces, and its noise is known to
// whoever knows the seed (docs/PRIVACY.md).
secagg::Key32 SiteRoundingKey(uint64_t seed, uint64_t round, uint32_t site);
secagg::Key32 SiteNoiseKey(uint64_t seed, uint64_t round, uint32_t site);

// The draw of a round of `sites` sites (site u is protocol id u), from
// MixSeed(MixSeed(seed, round), "secagg dropout"): the same in both modes,
// as it depends on nothing but these.
std::vector<SecAggDropStage> DrawSecAggDropouts(double dropout, uint32_t sites, uint64_t seed, uint64_t round);

// Runs the protocol over `inputs` (site i is protocol id i). Fails with the
// protocol's one line when fewer than t sites remain at some stage.
Result<SecAggRoundResult> RunSecAggRound(const SecAggOptions& options, std::span<const SecAggSiteInput> inputs,
                                         uint64_t seed, uint64_t round);

}  // namespace estuary::simulations
