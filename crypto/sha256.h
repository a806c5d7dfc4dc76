// SHA-256 over byte ranges (OpenSSL EVP); the checksum of models and updates.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>

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

}  // namespace estuary::crypto
