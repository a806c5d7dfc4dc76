#include "bench/tls_crypto_rate.h"

#include <openssl/evp.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

namespace estuary::bench {

namespace {

using Clock = std::chrono::steady_clock;
using PkeyPtr = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;
using CtxPtr = std::unique_ptr<EVP_PKEY_CTX, decltype(&EVP_PKEY_CTX_free)>;

// One thread's operation: false when OpenSSL failed.
using Operation = std::function<bool()>;

double ThreadCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
}

struct Rate {
  double per_second = 0;   // all threads together, wall clock
  double cpu_seconds = 0;  // one operation's CPU time
};

// Operations per second of `make()`'s operation (each thread makes its own,
// with its own contexts) on `threads` threads started together.
Result<Rate> RateOf(const char* what, int threads, double seconds, const std::function<Operation()>& make) {
  std::atomic<int> ready{0};
  std::atomic<bool> failed{false};
  std::vector<uint64_t> done(threads, 0);
  std::vector<double> elapsed(threads, 0), cpu(threads, 0);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      Operation op = make();
      ready.fetch_add(1);
      while (ready.load() < threads) std::this_thread::yield();
      const auto start = Clock::now();
      const double cpu_start = ThreadCpuSeconds();
      const auto until = start + std::chrono::duration<double>(seconds);
      uint64_t n = 0;
      while (Clock::now() < until) {
        for (int i = 0; i < 8; ++i) {
          if (!op || !op()) {
            failed = true;
            return;
          }
        }
        n += 8;
      }
      done[t] = n;
      cpu[t] = ThreadCpuSeconds() - cpu_start;
      elapsed[t] = std::chrono::duration<double>(Clock::now() - start).count();
    });
  }
  for (auto& thread : pool) thread.join();
  if (failed) return Internal("crypto rate: {} failed in OpenSSL", what);
  Rate rate;
  double cpu_total = 0, ops = 0;
  for (int t = 0; t < threads; ++t) {
    rate.per_second += double(done[t]) / elapsed[t];
    cpu_total += cpu[t];
    ops += double(done[t]);
  }
  rate.cpu_seconds = cpu_total / ops;
  return rate;
}

PkeyPtr Keygen(const char* type, const char* curve) {
  return PkeyPtr(curve ? EVP_PKEY_Q_keygen(nullptr, nullptr, type, curve) : EVP_PKEY_Q_keygen(nullptr, nullptr, type),
                 EVP_PKEY_free);
}

// A derivation from `own` towards `peer` (both the same kind of key).
Operation Derive(EVP_PKEY* own, EVP_PKEY* peer) {
  auto ctx = std::make_shared<CtxPtr>(EVP_PKEY_CTX_new_from_pkey(nullptr, own, nullptr), EVP_PKEY_CTX_free);
  if (!*ctx || EVP_PKEY_derive_init(ctx->get()) != 1 || EVP_PKEY_derive_set_peer(ctx->get(), peer) != 1) return {};
  return [ctx] {
    unsigned char secret[64];
    size_t length = sizeof secret;
    return EVP_PKEY_derive(ctx->get(), secret, &length) == 1;
  };
}

}  // namespace

Result<CryptoRates> MeasureCryptoRates(int threads, double seconds_each) {
  CryptoRates rates;
  rates.threads = threads;
  PkeyPtr ec = Keygen("EC", "P-256"), ec_peer = Keygen("EC", "P-256");
  PkeyPtr x = Keygen("X25519", nullptr), x_peer = Keygen("X25519", nullptr);
  if (!ec || !ec_peer || !x || !x_peer) return Internal("crypto rate: cannot generate the keys");
  // A SHA-256 digest's worth, as TLS 1.3 signs the hash of its transcript.
  const unsigned char digest[32] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                                    17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32};
  unsigned char signature[80];
  size_t signature_length = sizeof signature;
  {
    CtxPtr ctx(EVP_PKEY_CTX_new_from_pkey(nullptr, ec.get(), nullptr), EVP_PKEY_CTX_free);
    if (!ctx || EVP_PKEY_sign_init(ctx.get()) != 1 ||
        EVP_PKEY_sign(ctx.get(), signature, &signature_length, digest, sizeof digest) != 1) {
      return Internal("crypto rate: cannot sign with P-256");
    }
  }
  ESTUARY_ASSIGN_OR_RETURN(const Rate sign, RateOf("ECDSA P-256 sign", threads, seconds_each, [&]() -> Operation {
    auto ctx = std::make_shared<CtxPtr>(EVP_PKEY_CTX_new_from_pkey(nullptr, ec.get(), nullptr), EVP_PKEY_CTX_free);
    if (!*ctx || EVP_PKEY_sign_init(ctx->get()) != 1) return {};
    return [ctx, &digest] {
      unsigned char out[80];
      size_t length = sizeof out;
      return EVP_PKEY_sign(ctx->get(), out, &length, digest, sizeof digest) == 1;
    };
  }));
  ESTUARY_ASSIGN_OR_RETURN(const Rate verify, RateOf("ECDSA P-256 verify", threads, seconds_each, [&]() -> Operation {
    auto ctx = std::make_shared<CtxPtr>(EVP_PKEY_CTX_new_from_pkey(nullptr, ec.get(), nullptr), EVP_PKEY_CTX_free);
    if (!*ctx || EVP_PKEY_verify_init(ctx->get()) != 1) return {};
    return [ctx, &digest, &signature, signature_length] {
      return EVP_PKEY_verify(ctx->get(), signature, signature_length, digest, sizeof digest) == 1;
    };
  }));
  ESTUARY_ASSIGN_OR_RETURN(const Rate keygen, RateOf("X25519 keygen", threads, seconds_each, [&]() -> Operation {
    auto ctx = std::make_shared<CtxPtr>(EVP_PKEY_CTX_new_from_name(nullptr, "X25519", nullptr), EVP_PKEY_CTX_free);
    if (!*ctx || EVP_PKEY_keygen_init(ctx->get()) != 1) return {};
    return [ctx] {
      EVP_PKEY* key = nullptr;
      const bool ok = EVP_PKEY_keygen(ctx->get(), &key) == 1;
      EVP_PKEY_free(key);
      return ok;
    };
  }));
  ESTUARY_ASSIGN_OR_RETURN(const Rate xderive, RateOf("X25519 derive", threads, seconds_each,
                                                       [&] { return Derive(x.get(), x_peer.get()); }));
  ESTUARY_ASSIGN_OR_RETURN(const Rate pderive, RateOf("ECDH P-256 derive", threads, seconds_each,
                                                     [&] { return Derive(ec.get(), ec_peer.get()); }));
  rates.ecdsa_sign = sign.per_second;
  rates.ecdsa_verify = verify.per_second;
  rates.x25519_keygen = keygen.per_second;
  rates.x25519_derive = xderive.per_second;
  rates.p256_derive = pderive.per_second;
  rates.cpu_seconds_per_end = sign.cpu_seconds + 2 * verify.cpu_seconds + keygen.cpu_seconds + xderive.cpu_seconds;
  return rates;
}

}  // namespace estuary::bench
