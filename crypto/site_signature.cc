#include "crypto/site_signature.h"

#include <openssl/err.h>
#include <openssl/x509v3.h>

#include "crypto/openssl_util.h"
#include "crypto/revocation.h"

namespace estuary::crypto {
namespace {

using internal::FreeWith;
using internal::TakeOpenSslErrors;
using internal::X509Ptr;
using MdContextPtr = std::unique_ptr<EVP_MD_CTX, FreeWith<EVP_MD_CTX_free>>;
using StoreContextPtr = std::unique_ptr<X509_STORE_CTX, FreeWith<X509_STORE_CTX_free>>;

Result<std::string> Der(X509* cert) {
  unsigned char* out = nullptr;
  const int length = i2d_X509(cert, &out);
  if (length <= 0) return Internal("crypto: cannot encode a certificate: {}", TakeOpenSslErrors());
  std::string der(reinterpret_cast<char*>(out), size_t(length));
  OPENSSL_free(out);
  return der;
}

Result<X509Ptr> ParseDer(std::string_view der) {
  const auto* begin = reinterpret_cast<const unsigned char*>(der.data());
  const unsigned char* p = begin;
  X509Ptr cert(d2i_X509(nullptr, &p, long(der.size())));
  if (!cert || p != begin + der.size()) {
    ERR_clear_error();
    return InvalidArgument("crypto: not a DER certificate ({} bytes)", der.size());
  }
  return cert;
}

// ECDSA and RSA sign a SHA-256 digest of the message; Ed25519 and Ed448 the message itself.
const EVP_MD* DigestFor(EVP_PKEY* key) {
  const int id = EVP_PKEY_get_id(key);
  return id == EVP_PKEY_ED25519 || id == EVP_PKEY_ED448 ? nullptr : EVP_sha256();
}

}  // namespace

Result<SiteSigner> SiteSigner::Make(X509* cert, EVP_PKEY* key) {
  SiteSigner signer;
  ESTUARY_ASSIGN_OR_RETURN(signer.certificate_, Der(cert));
  ESTUARY_ASSIGN_OR_RETURN(signer.common_name_, internal::CommonName(cert));
  if (EVP_PKEY_up_ref(key) != 1) return Internal("crypto: cannot hold the signing key: {}", TakeOpenSslErrors());
  signer.key_ = std::shared_ptr<EVP_PKEY>(key, EVP_PKEY_free);
  return signer;
}

Result<SiteSigner> SiteSigner::FromConnection(SSL* ssl) {
  X509* cert = SSL_get_certificate(ssl);
  EVP_PKEY* key = SSL_get_privatekey(ssl);
  if (cert == nullptr || key == nullptr) {
    return FailedPrecondition("crypto: the connection has no identity of its own to sign with");
  }
  return Make(cert, key);
}

Result<SiteSigner> SiteSigner::FromFiles(const TlsFiles& files) {
  ESTUARY_ASSIGN_OR_RETURN(X509Ptr cert, internal::ReadCertificate(files.cert));
  ESTUARY_ASSIGN_OR_RETURN(internal::PkeyPtr key, internal::ReadPrivateKey(files.key));
  ESTUARY_RETURN_IF_ERROR(internal::CheckKeyMatches(cert.get(), key.get(), files.cert, files.key));
  return Make(cert.get(), key.get());
}

Result<std::string> SiteSigner::Sign(std::string_view message) const {
  MdContextPtr context(EVP_MD_CTX_new());
  std::string signature(size_t(EVP_PKEY_get_size(key_.get())), '\0');
  size_t length = signature.size();
  if (!context || EVP_DigestSignInit(context.get(), nullptr, DigestFor(key_.get()), nullptr, key_.get()) != 1 ||
      EVP_DigestSign(context.get(), reinterpret_cast<unsigned char*>(signature.data()), &length,
                     reinterpret_cast<const unsigned char*>(message.data()), message.size()) != 1) {
    return Internal("crypto: signing as '{}' failed: {}", common_name_, TakeOpenSslErrors());
  }
  signature.resize(length);
  return signature;
}

Result<SiteVerifier> SiteVerifier::FromConnection(SSL* ssl) {
  X509_STORE* store = SSL_CTX_get_cert_store(SSL_get_SSL_CTX(ssl));
  if (store == nullptr || X509_STORE_up_ref(store) != 1) {
    return FailedPrecondition("crypto: the connection has no trust store to verify peers with");
  }
  SiteVerifier verifier;
  verifier.store_ = std::shared_ptr<X509_STORE>(store, X509_STORE_free);
  return verifier;
}

Result<SiteVerifier> SiteVerifier::FromFiles(const TlsFiles& files) {
  std::shared_ptr<X509_STORE> store(X509_STORE_new(), X509_STORE_free);
  if (!store) return Internal("crypto: cannot make a trust store: {}", TakeOpenSslErrors());
  ESTUARY_RETURN_IF_ERROR(internal::Trust(store.get(), files).status());
  SiteVerifier verifier;
  verifier.store_ = std::move(store);
  return verifier;
}

Result<std::string> SiteVerifier::Verify(std::string_view certificate, std::string_view message,
                                         std::string_view signature) const {
  ESTUARY_ASSIGN_OR_RETURN(X509Ptr cert, ParseDer(certificate));
  auto name = internal::CommonName(cert.get());
  const std::string who = name.ok() ? fmt::format("'{}'", *name) : "without a common name";
  StoreContextPtr context(X509_STORE_CTX_new());
  if (!context || X509_STORE_CTX_init(context.get(), store_.get(), cert.get(), nullptr) != 1 ||
      X509_STORE_CTX_set_purpose(context.get(), X509_PURPOSE_SSL_CLIENT) != 1) {
    return Internal("crypto: cannot verify a certificate: {}", TakeOpenSslErrors());
  }
  if (X509_verify_cert(context.get()) != 1) {
    const int error = X509_STORE_CTX_get_error(context.get());
    ERR_clear_error();
    return InvalidArgument("crypto: certificate {} is not a site certificate of this federation: {}", who,
                           X509_verify_cert_error_string(error));
  }
  if (internal::StatedRoles(cert.get()) != XKU_SSL_CLIENT) {
    return InvalidArgument("crypto: certificate {} is not a site's: its extendedKeyUsage does not state clientAuth "
                           "alone",
                           who);
  }
  EVP_PKEY* key = X509_get0_pubkey(cert.get());
  MdContextPtr verify(EVP_MD_CTX_new());
  if (key == nullptr || !verify ||
      EVP_DigestVerifyInit(verify.get(), nullptr, DigestFor(key), nullptr, key) != 1 ||
      EVP_DigestVerify(verify.get(), reinterpret_cast<const unsigned char*>(signature.data()), signature.size(),
                       reinterpret_cast<const unsigned char*>(message.data()), message.size()) != 1) {
    ERR_clear_error();
    return InvalidArgument("crypto: the signature of {} does not verify", who);
  }
  ESTUARY_RETURN_IF_ERROR(name.status());
  return *name;
}

Result<std::string> CertificateCommonName(std::string_view certificate) {
  ESTUARY_ASSIGN_OR_RETURN(X509Ptr cert, ParseDer(certificate));
  return internal::CommonName(cert.get());
}

}  // namespace estuary::crypto
