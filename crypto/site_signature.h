// Signatures by a site's certificate key over what the server relays from
// one site to another, so that the relay cannot forge or substitute it:
// SecAgg+'s advertised public keys (docs/SECAGG.md), which a server that
// swapped them could use to open the shares sealed to them.
//
// A SiteSigner holds a site's private key and certificate; a SiteVerifier the
// federation's trust (its CA and, where the site has one, the CA's CRL). Both
// come from the site's live TLS connection (the identity and trust store it
// authenticated with) or from the same files. Signatures are ECDSA P-256 with
// SHA-256 for the federation's own certificates (any key OpenSSL signs with:
// SHA-256, or none for Ed25519 and Ed448). Both are cheap to copy and safe
// to use from any one thread at a time.
//
// A SiteVerifier remembers each certificate it found to be a site's, with
// its key, and checks only the signature when the same certificate comes
// again: a SecAgg+ site checks each neighbour's certificate twice a round,
// and the chain's signature costs as much as the message's. Verifiers made
// from one connection's trust store share that memory (and with it the
// store's lifetime), as do copies; one made from files has its own. A
// remembered certificate is checked afresh kRecheckAfter after it last was,
// and never trusted past its notAfter.
#pragma once

#include <openssl/ssl.h>

#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include "base/status.h"
#include "crypto/tls.h"

namespace estuary::crypto {

class SiteSigner {
 public:
  // The identity `ssl` presents (its certificate and key): a site's connection.
  static Result<SiteSigner> FromConnection(SSL* ssl);
  static Result<SiteSigner> FromFiles(const TlsFiles& files);

  Result<std::string> Sign(std::string_view message) const;
  const std::string& certificate() const { return certificate_; }  // DER
  const std::string& common_name() const { return common_name_; }

 private:
  static Result<SiteSigner> Make(X509* cert, EVP_PKEY* key);

  std::shared_ptr<EVP_PKEY> key_;
  std::string certificate_;
  std::string common_name_;
};

class SiteVerifier {
 public:
  // The trust store `ssl` verified its peer against.
  static Result<SiteVerifier> FromConnection(SSL* ssl);
  static Result<SiteVerifier> FromFiles(const TlsFiles& files);

  // The common name of `certificate` (DER), once it is a site certificate of
  // the federation — it chains to the CA, states clientAuth and only that, is
  // current and, with a CRL, not revoked — and `signature` is its key's over
  // `message`. Otherwise one line saying which check failed. With
  // `message_sha256` (SHA-256 of `message`, 32 bytes) an ECDSA or RSA
  // signature is checked against it and `message` is not hashed again: a
  // caller verifying many signatures over one long message hashes it once.
  // The caller vouches that it is the digest of `message`.
  Result<std::string> Verify(std::string_view certificate, std::string_view message, std::string_view signature,
                             std::string_view message_sha256 = {}) const;

  static constexpr std::chrono::seconds kRecheckAfter{60};

 private:
  struct Verified;
  class Memory;
  // The site certificate `certificate` is, checked now or remembered.
  Result<std::shared_ptr<const Verified>> SiteCertificate(std::string_view certificate) const;

  std::shared_ptr<X509_STORE> store_;
  std::shared_ptr<Memory> memory_;
};

// The subject common name of a DER certificate, unverified.
Result<std::string> CertificateCommonName(std::string_view certificate);

}  // namespace estuary::crypto
