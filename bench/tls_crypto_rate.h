// What OpenSSL's public-key operations allow a TLS 1.3 mutual-authentication
// handshake rate to be, measured in the calling process, for
// bench/connections (the server's handshake rate, as a ratio to this bound).
//
// A federation's certificates are ECDSA P-256 (crypto/certs.h) and its
// connections agree keys over X25519 (crypto/tls.cc offers X25519 first and
// both ends are ours). Each end of one full handshake (no resumption: the
// server issues no tickets) then does, in public-key operations:
//   - one X25519 key generation (its key share) and one X25519 derivation;
//   - one ECDSA P-256 sign (its CertificateVerify);
//   - two ECDSA P-256 verifies: the peer's CertificateVerify, and the CA's
//     signature on the peer's leaf certificate (the CA is the trust anchor:
//     its self-signature is not checked).
// MeasureCryptoRates times each operation as `openssl speed ecdsap256
// x25519` does (EVP calls in a loop), on `threads` threads at once, so the
// rates are those of these cores under whatever else runs on them now. The
// bound counts only these operations: hashing, AES-GCM, certificate parsing
// and the protocol itself are what the achieved rate loses beside them.
#pragma once

#include "base/status.h"

namespace estuary::bench {

struct CryptoRates {
  int threads = 1;
  // Operations per second, all threads together.
  double ecdsa_sign = 0, ecdsa_verify = 0, x25519_keygen = 0, x25519_derive = 0;
  double p256_derive = 0;  // ECDH over P-256, for reference (openssl speed ecdhp256)
  // CPU seconds one end of a handshake's operations take (each thread's own
  // CPU clock, so what other processes take from these cores is not in it).
  double cpu_seconds_per_end = 0;

  // Seconds of these cores one end of a handshake takes (the list above).
  double SecondsPerEnd() const {
    return 1 / ecdsa_sign + 2 / ecdsa_verify + 1 / x25519_keygen + 1 / x25519_derive;
  }
  // Handshakes per second the server's share of the crypto allows, all cores
  // its own; and with both ends on the same cores (a loopback bench).
  double ServerBound() const { return 1 / SecondsPerEnd(); }
  double BothEndsBound() const { return 1 / (2 * SecondsPerEnd()); }
};

// Each operation for about `seconds_each` seconds on `threads` threads.
Result<CryptoRates> MeasureCryptoRates(int threads, double seconds_each = 0.5);

}  // namespace estuary::bench
