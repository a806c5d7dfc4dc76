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
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/status.h"

namespace estuary::simulations {

struct SecAggOptions {
  int neighbours = 0;   // k; 0: secagg::DefaultDegree(n)
  int threshold = 0;    // t; 0: secagg::DefaultThreshold(k)
  int bits = 32;        // the ring Z/2^bits, 2..32
  double clip = 100;    // C: the L2 norm each update is clipped to before weighting
  double dropout = 0;   // per sampled site, in [0, 1)
};

// The options, and the protocol they make for rounds of `sites` sites.
Status CheckSecAggOptions(const SecAggOptions& options, uint32_t sites);

struct SecAggSiteInput {
  std::span<const float> update;  // local − global
  double examples = 0;            // its weight, > 0
};

struct SecAggRoundResult {
  std::vector<float> mean;        // the example-weighted mean of the included sites' clipped updates
  std::vector<size_t> included;   // indices into the inputs, ascending
  double included_weight = 0;     // Σ examples of the included sites
  uint32_t dropouts = 0;          // sites that stopped at some stage
  uint32_t clipped = 0;           // updates whose norm exceeded C
  uint64_t bytes_per_site = 0;    // mean over the sampled sites, sent + received
  double seconds = 0;
  double error_bound = 0;         // per element of `mean`
  int neighbours = 0, threshold = 0;
};

// Runs the protocol over `inputs` (site i is protocol id i). Fails with the
// protocol's one line when fewer than t sites remain at some stage.
Result<SecAggRoundResult> RunSecAggRound(const SecAggOptions& options, std::span<const SecAggSiteInput> inputs,
                                         uint64_t seed, uint64_t round);

}  // namespace estuary::simulations
