// The digest of bytes in transit: XXH3-128, written as 32 lowercase hex
// digits. It checks end to end that what arrived was put back where it
// belongs (chunk offsets, patch ranges, low-rank factors applied). It is not
// a cryptographic hash and need not be one: TLS already authenticates every
// byte a peer sends. It runs at 8-9 GB/s a core, where SHA-256 (1.25 GB/s
// with SHA-NI) cost more than the transfer's encryption. What outlives a
// transfer (the round log's model checksum, a checkpoint's) stays SHA-256
// (crypto/sha256.h).
#pragma once

#include <cstddef>
#include <string>

namespace estuary::crypto {

inline constexpr size_t kTransferDigestHexDigits = 32;

class TransferDigest {
 public:
  TransferDigest();
  ~TransferDigest();
  TransferDigest(const TransferDigest&) = delete;
  TransferDigest& operator=(const TransferDigest&) = delete;
  void Update(const void* data, size_t size);
  std::string FinalHex();  // the digest cannot be updated afterwards

 private:
  struct State;
  State* state_;
  bool finalized_ = false;
};

// The transfer digest of one byte range.
std::string TransferDigestHex(const void* data, size_t size);

}  // namespace estuary::crypto
