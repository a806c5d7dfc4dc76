// Internal to estuary_crypto: RAII owners for OpenSSL objects and PEM loading
// that reports problems as one line naming the file. Not part of the public
// contract; certs.cc and tls.cc share it so their messages read the same.
#pragma once

#include <openssl/evp.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace estuary::crypto {
struct CrlInfo;   // crypto/revocation.h
struct TlsFiles;  // crypto/tls.h
}  // namespace estuary::crypto

namespace estuary::crypto::internal {

template <auto FreeFn>
struct FreeWith {
  template <typename T>
  void operator()(T* p) const { FreeFn(p); }
};
using X509Ptr = std::unique_ptr<X509, FreeWith<X509_free>>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, FreeWith<EVP_PKEY_free>>;
using BioPtr = std::unique_ptr<BIO, FreeWith<BIO_free_all>>;
using CrlPtr = std::unique_ptr<X509_CRL, FreeWith<X509_CRL_free>>;

// Drains OpenSSL's thread-local error queue into "reason; reason", or
// `fallback` when it is empty. Draining matters: a stale entry would otherwise
// be blamed for the next, unrelated failure.
std::string TakeOpenSslErrors(std::string_view fallback = "no OpenSSL error recorded");

// Reads a whole file, distinguishing "missing" (NotFound) from "unreadable"
// (IoError). Messages are "crypto: <path>: <problem>".
Result<std::string> ReadSmallFile(const std::filesystem::path& path);

// All certificates in a PEM file, in order (leaf first for a chain). Fails if
// the file is missing, is not PEM, or holds no certificate.
Result<std::vector<X509Ptr>> ReadCertificates(const std::filesystem::path& path);
// The first certificate of a PEM file.
Result<X509Ptr> ReadCertificate(const std::filesystem::path& path);
// An unencrypted PEM private key. Never prompts for a passphrase.
Result<PkeyPtr> ReadPrivateKey(const std::filesystem::path& path);
// Fails, naming key_path, unless `key` is the private half of `cert`.
Status CheckKeyMatches(X509* cert, EVP_PKEY* key, const std::filesystem::path& cert_path,
                       const std::filesystem::path& key_path);

// Subject CN of `cert` as UTF-8, or an error if it has none.
Result<std::string> CommonName(X509* cert);

// The roles `cert` states in its extendedKeyUsage: XKU_SSL_SERVER,
// XKU_SSL_CLIENT, both or neither. A certificate without the extension is
// valid for every use as far as OpenSSL's purpose check goes, and one issued
// before roles (estuary 0.1) states both: either could serve a federation as
// well as join it. We want exactly one role stated, so a site's certificate
// cannot pass as the server's or the reverse.
uint32_t StatedRoles(X509* cert);

// Puts files.ca's certificates into `store`, and with files.crl, the list
// too and the check of every leaf certificate against it (a revoked one fails
// to verify: "certificate revoked"). Returns the CRL's contents (none: empty).
// (crypto/tls.cc)
Result<CrlInfo> Trust(X509_STORE* store, const TlsFiles& files);

// A serial number as lowercase hex without leading zeros ("" if unreadable).
std::string SerialHex(const ASN1_INTEGER* serial);

// The one CRL of a PEM file; fails, naming the file, as ReadCertificates does.
Result<CrlPtr> ReadCrlFile(const std::filesystem::path& path);
// ReadCrl's checks (crypto/revocation.h), keeping the parsed list too.
Result<CrlPtr> ReadCheckedCrl(const std::filesystem::path& crl, const std::filesystem::path& ca, CrlInfo* info);

}  // namespace estuary::crypto::internal
