// The byte types the secure-aggregation core passes around, and its source of
// randomness.
//
// Every secret here is 256 bits: X25519 keys, HKDF outputs, AES-256 keys and
// the seeds the masks are expanded from. Randomness comes only from OpenSSL's
// RAND_bytes (its CSPRNG, seeded by the operating system); nothing in secagg/
// draws from a statistical generator.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"

namespace estuary::secagg {

// A 256-bit key or seed.
using Key32 = std::array<uint8_t, 32>;

// 32 bytes from RAND_bytes; an error only if OpenSSL's generator refuses.
Result<Key32> RandomKey();

// Lowercase hex of `bytes`, for messages and tests.
std::string Hex(std::string_view bytes);
template <size_t N>
std::string Hex(const std::array<uint8_t, N>& bytes) {
  return Hex(std::string_view(reinterpret_cast<const char*>(bytes.data()), N));
}

namespace internal {
// `value` as 8 (or 4) big-endian bytes appended to `out`.
void AppendBigEndian64(std::string& out, uint64_t value);
void AppendBigEndian32(std::string& out, uint32_t value);
}  // namespace internal

}  // namespace estuary::secagg
