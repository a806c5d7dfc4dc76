#include "crypto/site_signature.h"

#include <openssl/err.h>
#include <openssl/x509v3.h>

#include <map>
#include <mutex>

#include "crypto/openssl_util.h"
#include "crypto/revocation.h"

namespace estuary::crypto {
namespace {

using internal::FreeWith;
using internal::TakeOpenSslErrors;
using internal::X509Ptr;
using MdContextPtr = std::unique_ptr<EVP_MD_CTX, FreeWith<EVP_MD_CTX_free>>;
using StoreContextPtr = std::unique_ptr<X509_STORE_CTX, FreeWith<X509_STORE_CTX_free>>;
using PkeyContextPtr = std::unique_ptr<EVP_PKEY_CTX, FreeWith<EVP_PKEY_CTX_free>>;

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

struct SiteVerifier::Verified {
  std::shared_ptr<EVP_PKEY> key;
  std::string common_name;
  std::chrono::system_clock::time_point recheck_at;  // the sooner of kRecheckAfter and the certificate's notAfter
};

class SiteVerifier::Memory {
 public:
  std::shared_ptr<const Verified> Find(std::string_view der) {
    std::lock_guard lock(mutex_);
    const auto it = by_der_.find(der);
    if (it == by_der_.end()) return nullptr;
    if (std::chrono::system_clock::now() >= it->second->recheck_at) {
      by_der_.erase(it);
      return nullptr;
    }
    return it->second;
  }
  void Remember(std::string_view der, std::shared_ptr<const Verified> verified) {
    std::lock_guard lock(mutex_);
    if (by_der_.size() >= kMaxRemembered) by_der_.clear();  // a bound, not a policy: a round's neighbours fit
    by_der_.insert_or_assign(std::string(der), std::move(verified));
  }

 private:
  static constexpr size_t kMaxRemembered = 4096;
  std::mutex mutex_;
  std::map<std::string, std::shared_ptr<const Verified>, std::less<>> by_der_;
};

namespace {

// A trust store's SiteVerifier memory rides on the store as its ex_data, so
// every verifier made from it shares one and it goes with the store.
void FreeStoreMemory(void*, void* memory, CRYPTO_EX_DATA*, int, long, void*) {
  delete static_cast<std::shared_ptr<void>*>(memory);
}

int StoreMemoryIndex() {
  static const int index = X509_STORE_get_ex_new_index(0, nullptr, nullptr, nullptr, FreeStoreMemory);
  return index;
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
  static std::mutex attaching;  // two first verifiers of one store make one memory
  std::lock_guard lock(attaching);
  const int index = StoreMemoryIndex();
  auto* held = static_cast<std::shared_ptr<void>*>(index < 0 ? nullptr : X509_STORE_get_ex_data(store, index));
  if (held == nullptr) {
    auto owned = std::make_unique<std::shared_ptr<void>>(std::make_shared<Memory>());
    if (index >= 0 && X509_STORE_set_ex_data(store, index, owned.get()) == 1) {
      held = owned.release();
    } else {  // not shared, but still remembered within this verifier
      ERR_clear_error();
      verifier.memory_ = std::static_pointer_cast<Memory>(*owned);
      return verifier;
    }
  }
  verifier.memory_ = std::static_pointer_cast<Memory>(*held);
  return verifier;
}

Result<SiteVerifier> SiteVerifier::FromFiles(const TlsFiles& files) {
  std::shared_ptr<X509_STORE> store(X509_STORE_new(), X509_STORE_free);
  if (!store) return Internal("crypto: cannot make a trust store: {}", TakeOpenSslErrors());
  ESTUARY_RETURN_IF_ERROR(internal::Trust(store.get(), files).status());
  SiteVerifier verifier;
  verifier.store_ = std::move(store);
  verifier.memory_ = std::make_shared<Memory>();
  return verifier;
}

Result<std::shared_ptr<const SiteVerifier::Verified>> SiteVerifier::SiteCertificate(
    std::string_view certificate) const {
  if (auto remembered = memory_->Find(certificate)) return remembered;
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
  ESTUARY_RETURN_IF_ERROR(name.status());
  EVP_PKEY* key = X509_get0_pubkey(cert.get());
  if (key == nullptr || EVP_PKEY_up_ref(key) != 1) {
    return Internal("crypto: cannot hold the key of certificate {}: {}", who, TakeOpenSslErrors());
  }
  auto verified = std::make_shared<Verified>();
  verified->key = std::shared_ptr<EVP_PKEY>(key, EVP_PKEY_free);
  verified->common_name = *name;
  const auto now = std::chrono::system_clock::now();
  verified->recheck_at = now + kRecheckAfter;
  int days = 0, seconds = 0;  // from now to notAfter; it verified, so notAfter is ahead
  if (ASN1_TIME_diff(&days, &seconds, nullptr, X509_get0_notAfter(cert.get())) == 1) {
    verified->recheck_at = std::min(verified->recheck_at, now + std::chrono::seconds(int64_t(days) * 86400 + seconds));
  } else {
    verified->recheck_at = now;  // not remembered
  }
  memory_->Remember(certificate, verified);
  return std::shared_ptr<const Verified>(std::move(verified));
}

Result<std::string> SiteVerifier::Verify(std::string_view certificate, std::string_view message,
                                         std::string_view signature, std::string_view message_sha256) const {
  ESTUARY_ASSIGN_OR_RETURN(std::shared_ptr<const Verified> site, SiteCertificate(certificate));
  EVP_PKEY* key = site->key.get();
  if (DigestFor(key) != nullptr && message_sha256.size() == 32) {
    // The same check over the digest given: ECDSA and RSA verify SHA-256(message).
    PkeyContextPtr verify(EVP_PKEY_CTX_new(key, nullptr));
    if (!verify || EVP_PKEY_verify_init(verify.get()) != 1 ||
        EVP_PKEY_CTX_set_signature_md(verify.get(), EVP_sha256()) != 1 ||
        EVP_PKEY_verify(verify.get(), reinterpret_cast<const unsigned char*>(signature.data()), signature.size(),
                        reinterpret_cast<const unsigned char*>(message_sha256.data()), message_sha256.size()) != 1) {
      ERR_clear_error();
      return InvalidArgument("crypto: the signature of '{}' does not verify", site->common_name);
    }
    return site->common_name;
  }
  MdContextPtr verify(EVP_MD_CTX_new());
  if (!verify || EVP_DigestVerifyInit(verify.get(), nullptr, DigestFor(key), nullptr, key) != 1 ||
      EVP_DigestVerify(verify.get(), reinterpret_cast<const unsigned char*>(signature.data()), signature.size(),
                       reinterpret_cast<const unsigned char*>(message.data()), message.size()) != 1) {
    ERR_clear_error();
    return InvalidArgument("crypto: the signature of '{}' does not verify", site->common_name);
  }
  return site->common_name;
}

Result<std::string> CertificateCommonName(std::string_view certificate) {
  ESTUARY_ASSIGN_OR_RETURN(X509Ptr cert, ParseDer(certificate));
  return internal::CommonName(cert.get());
}

}  // namespace estuary::crypto
