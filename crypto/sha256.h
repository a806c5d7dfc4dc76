// SHA-256 over byte ranges (OpenSSL EVP); the checksum of models and updates.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace estuary::crypto {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void Update(const void* data, size_t size);
  std::array<uint8_t, 32> Final();  // the hasher cannot be updated afterwards

 private:
  struct Impl;
  Impl* impl_;
};

std::string ToHex(std::span<const uint8_t> bytes);
// Lowercase hex SHA-256 of a byte range.
std::string Sha256Hex(const void* data, size_t size);

// Whether two hex digests spell the same bytes, in either case: a peer may
// write "AB12" for our "ab12". Anything but hex digits compares as written.
bool SameHexDigest(std::string_view a, std::string_view b);

}  // namespace estuary::crypto
