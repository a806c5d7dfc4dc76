// The messages of SecAgg+ (Bell et al., CCS 2020) between a site's
// SecAggClient (secagg/client.h) and the SecAggServer (secagg/server.h), as
// plain structs: the state machines know nothing of the transport, which
// relays these (the simulator in process; the federation's TLS connections
// next).
//
// One protocol instance is one round over sites 0..sites−1, all of which
// share a ProtocolConfig (the server's RAND_bytes graph seed among it):
//
//   round   site -> server           server -> site
//   0       AdvertiseKeys            KeysBroadcast (its neighbours' public keys)
//   1       ShareKeys (envelopes)    ShareInbox (envelopes addressed to it)
//   2       MaskedInput              SurvivorSet (U3: whose inputs are in the sum)
//   3       SurvivorsSigned          UnmaskRequest (the neighbours' signatures
//                                    over U3; the site unmasks by the U3 it signed)
//   4       UnmaskResponse           -
//
// and the server's output is the sum mod 2^bits of the quantised inputs of
// the sites whose MaskedInput arrived, with their ids.
//
// Every message is checked by whoever receives it: ids in range and in the
// right set, no duplicates, fixed sizes, the stage. A refused message changes
// nothing on the server (its sender counts as not having sent it); a site
// that refuses a message ends its part in the round.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "secagg/bytes.h"
#include "secagg/envelope.h"
#include "secagg/shamir.h"

namespace estuary::secagg {

struct ProtocolConfig {
  uint64_t round = 0;       // bound into every derived key and envelope
  uint32_t sites = 0;       // ids 0..sites−1
  int degree = 0;           // k: NeighbourGraph::Harary's (sites − 1: complete)
  int threshold = 0;        // t: in (k/2, k], a strict majority of a neighbourhood
  int bits = 32;            // the ring Z / 2^bits
  uint64_t dimension = 0;   // elements of every input
  Key32 graph_seed{};       // the neighbour graph's; the server's RandomKey()
};

// The defaults for `sites`: k = DefaultDegree, t = DefaultThreshold.
ProtocolConfig DefaultProtocolConfig(uint32_t sites, uint64_t dimension, uint64_t round, const Key32& graph_seed);
// A graph that exists, t in (k/2, k], bits in [1, 32], dimension >= 1.
Status CheckProtocolConfig(const ProtocolConfig& config);

// A share envelope's plaintext: the holder's share of the self-mask seed,
// then of the mask private key; sealed (secagg/envelope.h) it is this long.
inline constexpr size_t kSharePlaintextBytes = 2 * kShareValueBytes;
inline constexpr size_t kShareEnvelopeBytes = kEnvelopeNonceBytes + kSharePlaintextBytes + kEnvelopeTagBytes;

// Round 0, site -> server: its two public keys for this round.
struct AdvertiseKeys {
  uint32_t site = 0;
  Key32 mask_public_key{};   // pairwise masks (its private key is Shamir-shared)
  Key32 share_public_key{};  // share envelopes
};

// Round 0, server -> one site: the keys of its neighbours that advertised.
struct KeysBroadcast {
  std::vector<AdvertiseKeys> neighbours;
};

// An envelope between two sites; `peer` is its receiver in ShareKeys and its
// sender in ShareInbox.
struct SealedShare {
  uint32_t peer = 0;
  std::vector<uint8_t> envelope;
};

// Round 1, site -> server: one envelope per advertised neighbour, and the
// commitments (secagg/shamir.h) the server checks its reconstructions with.
struct ShareKeys {
  uint32_t site = 0;
  Commitment seed_commitment{};
  Commitment key_commitment{};
  std::vector<SealedShare> envelopes;
};

// Round 1, server -> one site: the envelopes addressed to it by neighbours
// that completed round 1. Their senders are the neighbours it masks with.
struct ShareInbox {
  std::vector<SealedShare> envelopes;
};

// Round 2, site -> server: y = x + PRG(b_u) ± pairwise masks (secagg/masking.h).
struct MaskedInput {
  uint32_t site = 0;
  std::vector<uint32_t> values;
};

// Round 2, server -> each site whose MaskedInput arrived: U3, the sites whose
// inputs it summed (Bonawitz et al.'s consistency check). Each site signs it.
// On the wire it is a bitmap over the round's ids (secagg/wire.h).
struct SurvivorSet {
  std::vector<uint32_t> survived;
};
// The bitmap's length for `sites` ids: ceil(sites / 8).
inline constexpr uint64_t SurvivorBitmapBytes(uint32_t sites) { return (uint64_t(sites) + 7) / 8; }

// Round 3, site -> server: its signature over SurvivorsToSign(config, U3).
// The state machines relay it and never look inside: a site's
// SignatureCheck (secagg/client.h) verifies it.
struct SurvivorsSigned {
  uint32_t site = 0;
  std::string signature;
};
// A signature longer than this is refused (ECDSA P-256 is at most 72 bytes,
// RSA-4096 512).
inline constexpr size_t kMaxSurvivorSignatureBytes = 1024;

// The bytes a site signs to confirm U3: a fixed label, the round, the sites,
// the graph seed and U3 in ascending order. Bound so, a signature confirms
// only this set, in this round of this federation.
std::string SurvivorsToSign(const ProtocolConfig& config, std::span<const uint32_t> survived_ascending);

// Round 3, server -> each site that signed U3: the signatures of the site's
// neighbours in U3 that signed. It repeats no set: the site unmasks by the U3
// it signed — a b_v share for each neighbour v in U3, an sk_v share for each
// neighbour outside U3 whose shares it holds — so a request cannot ask for
// anything but what that one set implies, and costs O(k), not O(n), bytes.
struct UnmaskRequest {
  std::vector<SurvivorsSigned> signatures;
};

struct PeerShare {
  uint32_t peer = 0;  // whose secret this is a share of
  std::array<uint8_t, kShareValueBytes> y{};
};

// Round 4, site -> server: its shares, never both of one peer.
struct UnmaskResponse {
  uint32_t site = 0;
  std::vector<PeerShare> seed_shares;  // of neighbours in U3
  std::vector<PeerShare> key_shares;   // of neighbours that shared keys but are not in U3
};

// The server's result.
struct AggregateOutput {
  std::vector<uint32_t> sum;       // Σ x_u over `included`, mod 2^bits
  std::vector<uint32_t> included;  // ascending: the sites whose MaskedInput arrived
  std::vector<uint32_t> dropped;   // completed round 1, input never arrived (masks cancelled)
};

// What a message costs on the wire, at least: 4 bytes an id, count or
// element, 32 a key or commitment, 66 a share value, an envelope its length
// plus 8 (receiver and length), a signature its length plus 8 (signer and
// length), U3 one bit per site of the round (SurvivorBitmapBytes) plus 4. A
// real encoding adds its framing.
uint64_t WireBytes(const AdvertiseKeys& message);
uint64_t WireBytes(const KeysBroadcast& message);
uint64_t WireBytes(const ShareKeys& message);
uint64_t WireBytes(const ShareInbox& message);
uint64_t WireBytes(const MaskedInput& message);
uint64_t WireBytes(const SurvivorSet& message, uint32_t sites);
uint64_t WireBytes(const SurvivorsSigned& message);
uint64_t WireBytes(const UnmaskRequest& message);
uint64_t WireBytes(const UnmaskResponse& message);

}  // namespace estuary::secagg
