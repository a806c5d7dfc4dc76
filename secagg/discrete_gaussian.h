// Discrete Gaussian noise for distributed differential privacy under secure
// aggregation: each site adds its share to its quantised update before it
// masks it, so the server only ever unmasks a noised sum.
//
// The discrete Gaussian N_Z(0, σ²) puts mass ∝ exp(−x² / (2σ²)) on each
// integer x. Sampler: Canonne, Kamath and Steinke 2020 ("The Discrete
// Gaussian for Differential Privacy", Algorithms 1–3), which is exact — it
// uses integer arithmetic and fair coins only, no floating point:
//   Bernoulli(exp(−γ)) for rational γ   by the alternating-series trick
//                                       (Alg. 1; γ > 1 as ⌊γ⌋ coins of e⁻¹),
//   the discrete Laplace of scale t     (Alg. 2),
//   N_Z(0, σ²)                          by rejection from the discrete
//                                       Laplace with t = ⌊σ⌋ + 1 (Alg. 3),
//                                       accepting Y with probability
//                                       exp(−(|Y| − σ²/t)² / (2σ²)).
// σ² is an integer V here (1 ≤ V ≤ 2^52), so every probability is a ratio
// of integers below 2^126 and the arithmetic is unsigned __int128, exact.
// The one departure from exactness: a Laplace draw with |Y| > 2^36 (whose
// acceptance term would not fit) is rejected; it occurs with probability
// below exp(−2^36 / (2^26 + 1)) < e^−1000 per draw.
//
// The coins come from an AES-256-CTR keystream (secagg/prg.h's ExpandMask) under
// a 32-byte key: RandomKey() (RAND_bytes) on a live site; the simulator keys
// it from its seed so a run reproduces, which makes the noise predictable to
// whoever holds the seed. No statistical generator is involved either way.
// Not constant-time: the number of coins depends on the value drawn.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/status.h"
#include "secagg/bytes.h"
#include "secagg/prg.h"

namespace estuary::secagg {

// The largest σ² the sampler takes (its arithmetic fits 128 bits below it).
inline constexpr uint64_t kMaxDiscreteGaussianVariance = uint64_t{1} << 52;

// Draws from N_Z(0, V) with the coins of one AES-256-CTR stream.
class DiscreteGaussianSampler {
 public:
  // V in [1, kMaxDiscreteGaussianVariance].
  static Result<DiscreteGaussianSampler> Create(uint64_t variance, const Key32& key);

  // One draw; an error only if the keystream fails or runs out.
  Result<int64_t> Next();

  uint64_t variance() const { return variance_; }

 private:
  DiscreteGaussianSampler(uint64_t variance, const Key32& key);

  Result<uint64_t> Word();
  Result<unsigned __int128> UniformBelow(unsigned __int128 n);      // n >= 1
  Result<bool> Bernoulli(unsigned __int128 a, unsigned __int128 b);  // a / b, a <= b, b >= 1
  Result<bool> BernoulliExpMinus(unsigned __int128 a, unsigned __int128 b);  // exp(−a/b)
  Result<int64_t> DiscreteLaplace();                                 // scale t_

  uint64_t variance_;
  uint64_t t_;  // ⌊√V⌋ + 1
  // The key's AES-256-CTR stream, refilled 32 KiB at a time (ExpandMask).
  Key32 key_;
  uint64_t offset_ = 0;  // in 32-bit words
  std::vector<uint32_t> buffer_;
  size_t used_ = 0;
};

// values[i] += a draw of N_Z(0, V), mod 2^bits, in order of i: a site's share
// of the noise, added to its quantised update in the ring before masking.
Status AddDiscreteGaussian(std::span<uint32_t> values, uint64_t variance, int bits, const Key32& key);

}  // namespace estuary::secagg
