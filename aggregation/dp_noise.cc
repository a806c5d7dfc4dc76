#include "aggregation/dp_noise.h"

#include <openssl/evp.h>
#include <openssl/rand.h>

#include <cmath>
#include <cstring>
#include <numbers>

namespace estuary::aggregation {

void GaussianStream::CipherDeleter::operator()(EVP_CIPHER_CTX* ctx) const { EVP_CIPHER_CTX_free(ctx); }

GaussianStream::GaussianStream() : cipher_(EVP_CIPHER_CTX_new()) {}

GaussianStream::GaussianStream(GaussianStream&&) noexcept = default;
GaussianStream& GaussianStream::operator=(GaussianStream&&) noexcept = default;
GaussianStream::~GaussianStream() = default;

// OpenSSL's ChaCha20 IV is a 32-bit little-endian block counter, then a
// 96-bit nonce.
Result<GaussianStream> GaussianStream::FromKey(const std::array<unsigned char, 32>& key,
                                               const std::array<unsigned char, 16>& iv) {
  GaussianStream stream;
  if (stream.cipher_ == nullptr) return Internal("dp noise: EVP_CIPHER_CTX_new failed");
  if (EVP_EncryptInit_ex(stream.cipher_.get(), EVP_chacha20(), nullptr, key.data(), iv.data()) != 1) {
    return Internal("dp noise: ChaCha20 initialisation failed");
  }
  return stream;
}

Result<GaussianStream> GaussianStream::Unpredictable() {
  std::array<unsigned char, 32> key;
  std::array<unsigned char, 16> iv{};
  if (RAND_bytes(key.data(), int(key.size())) != 1) return Internal("dp noise: RAND_bytes failed to seed the noise");
  auto stream = FromKey(key, iv);
  OPENSSL_cleanse(key.data(), key.size());
  return stream;
}

Result<GaussianStream> GaussianStream::Seeded(uint64_t seed, uint64_t round) {
  // The key is a hash of the seed, domain-separated from the other uses of
  // the seed (sampling, init, shuffling), so the noise is independent of them.
  std::string material = "estuary dp-fedavg noise key v1:";
  for (int i = 0; i < 8; ++i) material.push_back(char((seed >> (8 * i)) & 0xff));
  std::array<unsigned char, 32> key;
  unsigned int length = 0;
  if (EVP_Digest(material.data(), material.size(), key.data(), &length, EVP_sha256(), nullptr) != 1 || length != 32) {
    return Internal("dp noise: SHA-256 of the seed failed");
  }
  std::array<unsigned char, 16> iv{};  // counter 0, nonce = the round
  for (int i = 0; i < 8; ++i) iv[4 + i] = (unsigned char)((round >> (8 * i)) & 0xff);
  return FromKey(key, iv);
}

void GaussianStream::Refill() {
  // The keystream is ChaCha20 over zeros.
  static const std::array<unsigned char, sizeof(block_)> kZeros{};
  int written = 0;
  EVP_EncryptUpdate(cipher_.get(), reinterpret_cast<unsigned char*>(block_.data()), &written, kZeros.data(),
                    int(kZeros.size()));
  used_ = 0;
}

uint64_t GaussianStream::NextBits() {
  if (used_ == block_.size()) Refill();
  return block_[used_++];
}

double GaussianStream::NextUniform() { return double(NextBits() >> 11) * 0x1p-53; }

double GaussianStream::NextNormal() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  // 1 − U lies in (0, 1], so the logarithm is finite.
  const double radius = std::sqrt(-2.0 * std::log(1.0 - NextUniform()));
  const double angle = 2.0 * std::numbers::pi * NextUniform();
  spare_ = radius * std::sin(angle);
  has_spare_ = true;
  return radius * std::cos(angle);
}

void GaussianStream::AddNoise(std::span<double> values, double stddev) {
  for (double& value : values) value += stddev * NextNormal();
}

}  // namespace estuary::aggregation
