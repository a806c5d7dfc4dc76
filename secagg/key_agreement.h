// X25519 key agreement (RFC 7748) and HKDF-SHA256 (RFC 5869), from OpenSSL 3.
//
// Each site holds two X25519 key pairs per round, as in SecAgg: one whose
// agreed keys seed the pairwise masks (its private key is Shamir-shared, so
// the server can cancel a dropped site's masks), and one whose agreed keys
// encrypt the shares relayed through the server. The raw X25519 output is
// never used as a key: AgreeRoundKey runs it through HKDF-SHA256 with a label
// naming the use and the round number, so the two uses and any two rounds get
// independent keys from the same pair.
//
// AgreeRoundKey is symmetric: u with (sk_u, pk_v) and v with (sk_v, pk_u)
// derive the same key. A shared secret of all zeros (a peer key of small
// order) is refused by OpenSSL's derive and reported as an error.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "base/status.h"
#include "secagg/bytes.h"

namespace estuary::secagg {

// HKDF labels: one per use of an agreed key.
inline constexpr std::string_view kMaskKeyLabel = "estuary secagg pairwise mask";
inline constexpr std::string_view kShareKeyLabel = "estuary secagg share encryption";

struct X25519KeyPair {
  Key32 private_key{};  // 32 random bytes; X25519 clamps them when used
  Key32 public_key{};
};

// A fresh pair, the private key from RAND_bytes.
Result<X25519KeyPair> GenerateX25519KeyPair();
// The pair of a known private key (a reconstructed one, or a test vector).
Result<X25519KeyPair> X25519KeyPairFromPrivate(const Key32& private_key);

// The raw X25519 shared secret. Not a key: see AgreeRoundKey.
Result<Key32> X25519SharedSecret(const Key32& private_key, const Key32& peer_public_key);

// HKDF-SHA256 extract-and-expand to 32 bytes; an empty salt is RFC 5869's
// default (a string of zeros).
Result<Key32> HkdfSha256(std::span<const uint8_t> secret, std::span<const uint8_t> salt,
                         std::span<const uint8_t> info);

// HKDF-SHA256(X25519(private, peer), salt = "", info = label || 0x00 || round
// as 8 big-endian bytes).
Result<Key32> AgreeRoundKey(const Key32& private_key, const Key32& peer_public_key, std::string_view label,
                            uint64_t round);

}  // namespace estuary::secagg
