// The masks of SecAgg / SecAgg+ and the server's corrections, on ring chunks.
//
// Site u with quantised chunk x (elements [offset, offset + n) of its update)
// sends
//   y = x + PRG(b_u) + Σ_{v in N(u), u < v} PRG(s_uv) − Σ_{v in N(u), v < u} PRG(s_uv)   (mod 2^b)
// where b_u is u's fresh self-mask seed and s_uv = AgreeRoundKey(sk_u, pk_v,
// kMaskKeyLabel, round) its pairwise key with neighbour v (secagg/prg.h for
// PRG). Summed over a set of sites whose neighbours all sent, the pairwise
// masks cancel: u adds what v subtracts.
//
// The server sums what arrived (AddInto) and then, with secrets the surviving
// neighbours' Shamir shares let it reconstruct:
// - for every site whose vector is in the sum, removes PRG(b_u)
//   (RemoveSelfMask);
// - for every dropped site d (its vector never arrived), recomputes from d's
//   reconstructed mask private key and each surviving neighbour v's public key
//   the pairwise mask v applied for d, and cancels it
//   (RemoveDroppedSiteMasks).
// What is left is Σ x over the included sites, mod 2^b.
//
// Every function works on one chunk at a given offset, so an update can be
// masked, uploaded and unmasked in pieces; every piece of one update must use
// the same keys, and the offsets must not overlap.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/status.h"
#include "secagg/bytes.h"

namespace estuary::secagg {

struct PairwiseKey {
  uint32_t neighbour = 0;
  Key32 key{};  // s_uv
};

struct PeerPublicKey {
  uint32_t site = 0;
  Key32 public_key{};  // the peer's mask public key for this round
};

// Site `site`'s pairwise keys with `neighbours` for `round`, in their order.
Result<std::vector<PairwiseKey>> PairwiseMaskKeys(uint32_t site, const Key32& mask_private_key,
                                                  std::span<const PeerPublicKey> neighbours, uint64_t round);

// y = x + self mask ± pairwise masks over `values` (elements [offset, ...)).
// A neighbour equal to `site`, or listed twice, is refused.
Status MaskChunk(uint32_t site, const Key32& self_seed, std::span<const PairwiseKey> pairwise, int bits,
                 uint64_t offset, std::span<uint32_t> values);

// sum[i] = sum[i] + values[i] mod 2^b; the spans must be the same length.
Status AddInto(std::span<uint32_t> sum, std::span<const uint32_t> values, int bits);

// sum[i] = sum[i] − values[i] mod 2^b: what AddInto added, taken out again.
Status SubtractFrom(std::span<uint32_t> sum, std::span<const uint32_t> values, int bits);

// Σ values[i] · (2 (offset + i) + 1) mod 2^64: a position-weighted digest,
// additive over chunks (the digest of a whole is the sum of its pieces'), so
// a copy read back in other pieces than it arrived in still compares. Each
// weight is odd, so a change to any one element changes it. A check on the
// server's own copy, not against an adversary.
uint64_t MaskedDigest(uint64_t offset, std::span<const uint32_t> values);

// sum −= PRG(b_u) over the chunk: for a site whose vector is in the sum.
Status RemoveSelfMask(const Key32& self_seed, int bits, uint64_t offset, std::span<uint32_t> sum);

// For dropped site `dropped`, whose mask private key the server reconstructed:
// cancels, over the chunk, the pairwise mask each of `surviving_neighbours`
// (the neighbours of `dropped` whose vectors are in the sum) applied for it.
// v < d had added PRG(s_dv), so it is subtracted; v > d had subtracted it, so
// it is added back.
Status RemoveDroppedSiteMasks(uint32_t dropped, const Key32& dropped_mask_private_key,
                              std::span<const PeerPublicKey> surviving_neighbours, uint64_t round, int bits,
                              uint64_t offset, std::span<uint32_t> sum);

}  // namespace estuary::secagg
