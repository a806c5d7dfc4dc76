// Shamir t-of-n secret sharing of 32-byte secrets (X25519 private keys, mask
// seeds) over the prime field GF(p), p = 2^521 − 1.
//
// Why that field: every 32-byte secret is one field element (2^256 < p), so a
// secret is shared in one polynomial with no limbs to split and rejoin, and p
// is a well-known Mersenne prime (NIST P-521's). Arithmetic is OpenSSL's
// BIGNUM (BN_mod_*), coefficients from BN_priv_rand_range (RAND_bytes).
//
// Contract:
// - Split(secret, t, xs) draws a random polynomial f of degree t − 1 with
//   f(0) = secret and returns one share (x, f(x)) per x in xs. Each x must be
//   nonzero (f(0) is the secret) and distinct; 1 <= t <= |xs|.
// - Combine(shares, t, commitment) reconstructs from at least t shares. Fewer
//   are refused: t − 1 shares of a degree t − 1 polynomial say nothing about
//   f(0) (every value is equally likely), so there is nothing to return.
// - Tampering is detected, not corrected. Split also returns a commitment,
//   SHA-256 over a domain label and the secret; Combine recomputes it and
//   refuses a result that does not match, so a share whose x or y was changed
//   fails whenever it is among those interpolated. With more than t shares,
//   every share beyond the first t must also lie on the polynomial the first t
//   define. The commitment is hiding only because the secrets are 256-bit
//   random values; it is not for low-entropy secrets. In the protocol the
//   shares also travel inside AES-GCM envelopes (secagg/envelope.h), so a relay
//   that changes one fails the tag before Combine sees it.
//
// Not constant-time: BIGNUM's modular inverse and multiplication branch on
// their operands. Shares are combined by the server on values it is entitled
// to, but a site's Split runs on its secrets; a timing-hardened field is for a
// later version.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "base/status.h"
#include "secagg/bytes.h"

namespace estuary::secagg {

// Bytes of a field element, big-endian: ceil(521 / 8).
inline constexpr size_t kShareValueBytes = 66;

struct Share {
  uint32_t x = 0;                              // the holder's nonzero coordinate
  std::array<uint8_t, kShareValueBytes> y{};   // f(x), big-endian, < p
};

using Commitment = Key32;  // SHA-256("estuary secagg shamir v1" || secret)

struct SharedSecret {
  std::vector<Share> shares;  // in the order of xs
  Commitment commitment;
};

Commitment CommitToSecret(const Key32& secret);

Result<SharedSecret> Split(const Key32& secret, int threshold, std::span<const uint32_t> xs);

Result<Key32> Combine(std::span<const Share> shares, int threshold, const Commitment& commitment);

// Lagrange interpolation at 0 through exactly `shares` (distinct nonzero x,
// y < p), with no threshold and no commitment: the raw field element. For
// tests that show what too few shares give.
Result<std::array<uint8_t, kShareValueBytes>> InterpolateAtZero(std::span<const Share> shares);

}  // namespace estuary::secagg
