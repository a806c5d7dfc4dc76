// Quantisation of a site's float update into the masking ring Z / 2^b, and
// back for the server's sum.
//
// A site's update x (its weight w, e.g. its example count) becomes
//   q_i = StochasticRound(w · s · clip(x)_i)  as a b-bit two's-complement value,
// where clip scales x down to L2 norm <= C (unchanged if already within) and
// s is the scale (the number of integer steps per unit). Stochastic rounding
// rounds y up with probability y − floor(y), so E[q_i] = w · s · clip(x)_i and
// the sum's rounding error stays unbiased; its uniforms come from the AES-256-CTR
// stream of a 32-byte seed (RandomKey() on a live site; fixed in tests).
//
// The server sums q over the included sites mod 2^b and Dequantize reads the
// sum back as a signed b-bit value divided by s · W, W = Σ w: the weighted
// mean of the clipped updates.
//
// Overflow bound. |clip(x)_i| <= ||clip(x)||_2 <= C, so |q_i| <= w · C · s + 1
// (the +1 is rounding). The signed sum is read correctly iff it stays within
// [−2^(b−1), 2^(b−1) − 1], which holds whenever
//   Σ_sites (w · C · s + 1) <= 2^(b−1) − 1,
// i.e. n_sites · max|q| < 2^(b−1) for equal weights. CheckNoOverflow tests
// exactly that; Quantize refuses a single site that breaks it on its own.
//
// Error bound. Each site's rounding moves each element by less than one step,
// so each element of Dequantize's output is within
//   n_sites / (s · W)
// of the weighted mean of the clipped float updates (DequantizationErrorBound),
// up to double rounding.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/status.h"
#include "secagg/bytes.h"

namespace estuary::secagg {

struct QuantizationConfig {
  int bits = 32;             // the ring Z / 2^bits, 1..32
  double clip_norm = 1.0;    // C: L2 bound of an update before weighting
  double scale = 1 << 16;    // s: integer steps per unit
};

Status CheckQuantizationConfig(const QuantizationConfig& config);

// x scaled to L2 norm <= clip_norm, in double; an error for a non-finite value.
Result<std::vector<double>> ClipToNorm(std::span<const float> update, double clip_norm);

// The ring elements of w · s · clip(x), stochastically rounded with the
// stream of `rounding_seed`. weight must be finite and >= 0.
Result<std::vector<uint32_t>> Quantize(std::span<const float> update, double weight, const QuantizationConfig& config,
                                       const Key32& rounding_seed);

// The same chunk by chunk, as a site streams its update: ClipFactor makes one
// pass over the whole update (C / ||x|| when the norm exceeds C, else 1; an
// error for a non-finite value), and QuantizeChunk writes the ring elements of
// elements [offset, offset + chunk.size()) into `out` (as long as `chunk`),
// with the rounding stream's words from `offset`: equal, bit for bit, to the
// same range of Quantize's output.
Result<double> ClipFactor(std::span<const float> update, double clip_norm);
Status QuantizeChunk(std::span<const float> chunk, uint64_t offset, double weight, double clip_factor,
                     const QuantizationConfig& config, const Key32& rounding_seed, std::span<uint32_t> out);

// Whether sites with these weights can be summed without wrapping.
Status CheckNoOverflow(std::span<const double> weights, const QuantizationConfig& config);

// The signed sum / (s · total_weight); total_weight > 0.
Result<std::vector<double>> Dequantize(std::span<const uint32_t> sum, double total_weight,
                                       const QuantizationConfig& config);

// n_sites / (s · total_weight): how far each dequantised element may be from
// the weighted mean of the clipped updates.
double DequantizationErrorBound(int sites, double total_weight, const QuantizationConfig& config);

}  // namespace estuary::secagg
