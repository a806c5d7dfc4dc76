// GaussianStream: the Gaussian noise of central differential privacy, drawn
// from a ChaCha20 keystream (OpenSSL's EVP).
//
// A live server needs noise nobody can predict: Unpredictable() keys the
// stream from RAND_bytes, so neither a site nor a reader of the seed or the
// round log can subtract it. The simulator needs `--seed` reproducibility:
// Seeded(seed, round) keys it from SHA-256 of the seed and uses the round as
// the nonce, so every round's noise is fixed by (seed, round) alone and a
// resumed run draws what an uninterrupted one would, with no stream position
// to save. Seeded noise is NOT private against anyone who knows the seed.
//
// Uniforms take the top 53 bits of a 64-bit word (every double in [0, 1) on a
// 2^-53 grid); normals come from the Box–Muller transform in double, both of
// its outputs used in turn.
#pragma once

#include <openssl/types.h>

#include <array>
#include <cstdint>
#include <memory>
#include <span>

#include "base/status.h"

namespace estuary::aggregation {

class GaussianStream {
 public:
  static Result<GaussianStream> Unpredictable();
  static Result<GaussianStream> Seeded(uint64_t seed, uint64_t round);

  GaussianStream(GaussianStream&&) noexcept;
  GaussianStream& operator=(GaussianStream&&) noexcept;
  ~GaussianStream();

  uint64_t NextBits();
  // Uniform on [0, 1), a multiple of 2^-53.
  double NextUniform();
  // Standard normal.
  double NextNormal();
  // values[i] += stddev · N(0, 1), one fresh normal per value.
  void AddNoise(std::span<double> values, double stddev);

 private:
  static Result<GaussianStream> FromKey(const std::array<unsigned char, 32>& key,
                                        const std::array<unsigned char, 16>& iv);
  GaussianStream();
  void Refill();

  struct CipherDeleter {
    void operator()(EVP_CIPHER_CTX* ctx) const;
  };
  std::unique_ptr<EVP_CIPHER_CTX, CipherDeleter> cipher_;
  std::array<uint64_t, 64> block_{};  // 512 bytes of keystream
  size_t used_ = 64;
  double spare_ = 0;  // Box–Muller's second output
  bool has_spare_ = false;
};

}  // namespace estuary::aggregation
