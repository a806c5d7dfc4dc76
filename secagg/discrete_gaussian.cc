#include "secagg/discrete_gaussian.h"

#include <bit>
#include <cmath>

namespace estuary::secagg {
namespace {

using u128 = unsigned __int128;

// ⌊√v⌋, exact for every 64-bit v (the double estimate corrected both ways).
uint64_t IntegerSqrt(uint64_t v) {
  uint64_t r = uint64_t(std::sqrt(double(v)));
  while (u128(r) * r > v) --r;
  while (u128(r + 1) * (r + 1) <= v) ++r;
  return r;
}

int BitWidth(u128 n) {
  const uint64_t high = uint64_t(n >> 64);
  return high ? 64 + std::bit_width(high) : std::bit_width(uint64_t(n));
}

// A Laplace draw beyond this makes (|Y|·t − V)² overflow 128 bits; see the header.
constexpr uint64_t kMaxLaplace = uint64_t{1} << 36;

}  // namespace

DiscreteGaussianSampler::DiscreteGaussianSampler(uint64_t variance, const Key32& key)
    : variance_(variance), t_(IntegerSqrt(variance) + 1), key_(key), buffer_(8192), used_(buffer_.size()) {}

Result<DiscreteGaussianSampler> DiscreteGaussianSampler::Create(uint64_t variance, const Key32& key) {
  if (variance < 1 || variance > kMaxDiscreteGaussianVariance) {
    return InvalidArgument("secagg: discrete Gaussian variance {}: must be in [1, 2^52]", variance);
  }
  return DiscreteGaussianSampler(variance, key);
}

Result<uint64_t> DiscreteGaussianSampler::Word() {
  if (used_ + 2 > buffer_.size()) {
    ESTUARY_RETURN_IF_ERROR(ExpandMask(key_, offset_, 32, buffer_));
    offset_ += buffer_.size();
    used_ = 0;
  }
  const uint64_t low = buffer_[used_], high = buffer_[used_ + 1];
  used_ += 2;
  return low | (high << 32);
}

// Uniform on [0, n) by rejection: draw as many bits as n − 1 has.
Result<u128> DiscreteGaussianSampler::UniformBelow(u128 n) {
  if (n <= 1) return u128(0);
  const int bits = BitWidth(n - 1);
  for (;;) {
    ESTUARY_ASSIGN_OR_RETURN(const uint64_t low, Word());
    u128 draw = low;
    if (bits > 64) {
      ESTUARY_ASSIGN_OR_RETURN(const uint64_t high, Word());
      draw |= u128(high) << 64;
    }
    if (bits < 128) draw &= (u128(1) << bits) - 1;
    if (draw < n) return draw;
  }
}

Result<bool> DiscreteGaussianSampler::Bernoulli(u128 a, u128 b) {
  ESTUARY_ASSIGN_OR_RETURN(const u128 draw, UniformBelow(b));
  return draw < a;
}

// CKS20 Algorithm 1. For γ = a/b ∈ [0, 1]: draw A_k ~ Bernoulli(γ/k) for
// k = 1, 2, … until one is 0; the index K it stops at is odd with
// probability Σ (−γ)^j / j! = e^−γ. For γ > 1: ⌊γ⌋ independent coins of
// e^−1, then one of e^−(γ − ⌊γ⌋).
Result<bool> DiscreteGaussianSampler::BernoulliExpMinus(u128 a, u128 b) {
  while (a > b) {
    ESTUARY_ASSIGN_OR_RETURN(const bool coin, BernoulliExpMinus(1, 1));
    if (!coin) return false;
    a -= b;
  }
  // b · k stays below 2^128 for b < 2^106 and k < 2^20; reaching k = 2^20
  // takes 2^20 successes in a row, each of probability at most 1/k.
  uint64_t k = 1;
  for (;; ++k) {
    if (k >= (uint64_t{1} << 20)) return Internal("secagg: discrete Gaussian: Bernoulli(exp) ran past 2^20 terms");
    ESTUARY_ASSIGN_OR_RETURN(const bool coin, Bernoulli(a, b * k));
    if (!coin) break;
  }
  return k % 2 == 1;
}

// CKS20 Algorithm 2: P(X = x) ∝ exp(−|x| / t). U uniform on [0, t) kept with
// probability e^(−U/t) and V ~ Geometric(1 − e^−1) give |X| = U + t·V; the
// sign is a fair coin, with −0 rejected so that 0 is not counted twice.
Result<int64_t> DiscreteGaussianSampler::DiscreteLaplace() {
  for (;;) {
    ESTUARY_ASSIGN_OR_RETURN(const u128 u, UniformBelow(t_));
    ESTUARY_ASSIGN_OR_RETURN(const bool keep, BernoulliExpMinus(u, t_));
    if (!keep) continue;
    uint64_t v = 0;
    for (;;) {
      ESTUARY_ASSIGN_OR_RETURN(const bool more, BernoulliExpMinus(1, 1));
      if (!more) break;
      if (++v > kMaxLaplace) break;  // beyond any draw Next() accepts
    }
    const u128 x = u + u128(t_) * v;
    ESTUARY_ASSIGN_OR_RETURN(const uint64_t sign_word, Word());
    const bool negative = sign_word & 1;
    if (negative && x == 0) continue;
    if (x > kMaxLaplace) return int64_t(kMaxLaplace) + 1;  // rejected by Next()
    return negative ? -int64_t(x) : int64_t(x);
  }
}

// CKS20 Algorithm 3: Y from the discrete Laplace of scale t = ⌊σ⌋ + 1, kept
// with probability exp(−(|Y| − σ²/t)² / (2σ²)) = exp(−(|Y|·t − V)² / (2·V·t²)).
Result<int64_t> DiscreteGaussianSampler::Next() {
  for (;;) {
    ESTUARY_ASSIGN_OR_RETURN(const int64_t y, DiscreteLaplace());
    const uint64_t magnitude = uint64_t(y < 0 ? -y : y);
    if (magnitude > kMaxLaplace) continue;
    const u128 scaled = u128(magnitude) * t_;  // < 2^63
    const u128 gap = scaled > variance_ ? scaled - variance_ : u128(variance_) - scaled;
    const u128 numerator = gap * gap;                            // < 2^126
    const u128 denominator = u128(2) * variance_ * t_ * t_;      // < 2^106
    ESTUARY_ASSIGN_OR_RETURN(const bool keep, BernoulliExpMinus(numerator, denominator));
    if (keep) return y;
  }
}

Status AddDiscreteGaussian(std::span<uint32_t> values, uint64_t variance, int bits, const Key32& key) {
  ESTUARY_RETURN_IF_ERROR(CheckRingBits(bits));
  ESTUARY_ASSIGN_OR_RETURN(DiscreteGaussianSampler sampler, DiscreteGaussianSampler::Create(variance, key));
  const uint32_t mask = RingMask(bits);
  for (uint32_t& value : values) {
    ESTUARY_ASSIGN_OR_RETURN(const int64_t noise, sampler.Next());
    // Two's complement: adding a negative draw mod 2^32 subtracts it.
    value = (value + uint32_t(uint64_t(noise))) & mask;
  }
  return Status::Ok();
}

}  // namespace estuary::secagg
