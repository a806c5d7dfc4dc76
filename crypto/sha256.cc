#include "crypto/sha256.h"

#include <openssl/evp.h>

#include <algorithm>
#include <cassert>
#include <cstdio>
#include <cstdlib>

namespace estuary::crypto {
namespace {

// EVP only fails here on allocation failure or a broken OpenSSL install; there
// is no input that can make SHA-256 fail, so this is a programming/environment
// error rather than a Status.
void CheckEvp(int ok, const char* what) {
  if (ok != 1) {
    std::fprintf(stderr, "crypto: sha256: %s failed\n", what);
    std::abort();
  }
}

}  // namespace

struct Sha256::Impl {
  EVP_MD_CTX* ctx = nullptr;
  bool finalized = false;
};

Sha256::Sha256() : impl_(new Impl) {
  impl_->ctx = EVP_MD_CTX_new();
  CheckEvp(impl_->ctx != nullptr, "EVP_MD_CTX_new");
  CheckEvp(EVP_DigestInit_ex(impl_->ctx, EVP_sha256(), nullptr), "EVP_DigestInit_ex");
}

Sha256::~Sha256() {
  EVP_MD_CTX_free(impl_->ctx);
  delete impl_;
}

void Sha256::Update(const void* data, size_t size) {
  assert(!impl_->finalized);
  if (size == 0) return;
  CheckEvp(EVP_DigestUpdate(impl_->ctx, data, size), "EVP_DigestUpdate");
}

std::array<uint8_t, 32> Sha256::Final() {
  assert(!impl_->finalized);
  std::array<uint8_t, 32> digest{};
  unsigned int length = 0;
  CheckEvp(EVP_DigestFinal_ex(impl_->ctx, digest.data(), &length), "EVP_DigestFinal_ex");
  CheckEvp(length == digest.size(), "digest length");
  impl_->finalized = true;
  return digest;
}

std::string ToHex(std::span<const uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) {
    hex.push_back(kDigits[b >> 4]);
    hex.push_back(kDigits[b & 0x0f]);
  }
  return hex;
}

std::string Sha256Hex(const void* data, size_t size) {
  Sha256 hasher;
  hasher.Update(data, size);
  const auto digest = hasher.Final();
  return ToHex(digest);
}

bool SameHexDigest(std::string_view a, std::string_view b) {
  auto lower = [](char c) { return c >= 'A' && c <= 'F' ? char(c - 'A' + 'a') : c; };
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [&](char x, char y) { return lower(x) == lower(y); });
}

}  // namespace estuary::crypto
