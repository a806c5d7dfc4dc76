// The AES-256-GCM envelope a share travels in from one site to another
// through the server.
//
// The key is the pair's agreed share key (AgreeRoundKey with kShareKeyLabel),
// which the server does not know. The associated data binds the envelope to
// its sender, its receiver and the round, so the server can neither read a
// share nor deliver it to another site, swap its direction, or replay it in
// another round: each of those fails the tag on Open.
//
// Format: nonce (12 bytes from RAND_bytes) || ciphertext || tag (16 bytes).
// A random 96-bit nonce is safe here: each key seals one envelope per round
// (NIST's bound is 2^32 messages per key).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/status.h"
#include "secagg/bytes.h"

namespace estuary::secagg {

inline constexpr size_t kEnvelopeNonceBytes = 12;
inline constexpr size_t kEnvelopeTagBytes = 16;

struct EnvelopeContext {
  uint32_t sender = 0;
  uint32_t receiver = 0;
  uint64_t round = 0;
};

Result<std::vector<uint8_t>> Seal(const Key32& key, const EnvelopeContext& context,
                                  std::span<const uint8_t> plaintext);

// The plaintext, or an error (InvalidArgument) when the envelope is short,
// or its tag fails: another key, another context, or changed bytes.
Result<std::vector<uint8_t>> Open(const Key32& key, const EnvelopeContext& context, std::span<const uint8_t> sealed);

}  // namespace estuary::secagg
