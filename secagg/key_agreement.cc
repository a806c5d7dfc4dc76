#include "secagg/key_agreement.h"

#include <openssl/core_names.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/params.h>

#include <memory>
#include <string>

#include "crypto/openssl_util.h"

namespace estuary::secagg {
namespace {

using crypto::internal::FreeWith;
using crypto::internal::PkeyPtr;
using PkeyCtxPtr = std::unique_ptr<EVP_PKEY_CTX, FreeWith<EVP_PKEY_CTX_free>>;
using KdfPtr = std::unique_ptr<EVP_KDF, FreeWith<EVP_KDF_free>>;
using KdfCtxPtr = std::unique_ptr<EVP_KDF_CTX, FreeWith<EVP_KDF_CTX_free>>;

Status OpenSslError(std::string_view what) {
  return Internal("secagg: {} failed: {}", what, crypto::internal::TakeOpenSslErrors());
}

}  // namespace

Result<X25519KeyPair> GenerateX25519KeyPair() {
  ESTUARY_ASSIGN_OR_RETURN(Key32 private_key, RandomKey());
  return X25519KeyPairFromPrivate(private_key);
}

Result<X25519KeyPair> X25519KeyPairFromPrivate(const Key32& private_key) {
  PkeyPtr key(EVP_PKEY_new_raw_private_key(EVP_PKEY_X25519, nullptr, private_key.data(), private_key.size()));
  if (!key) return OpenSslError("X25519 private key");
  X25519KeyPair pair{.private_key = private_key};
  size_t length = pair.public_key.size();
  if (EVP_PKEY_get_raw_public_key(key.get(), pair.public_key.data(), &length) != 1 || length != 32) {
    return OpenSslError("X25519 public key");
  }
  return pair;
}

Result<Key32> X25519SharedSecret(const Key32& private_key, const Key32& peer_public_key) {
  PkeyPtr mine(EVP_PKEY_new_raw_private_key(EVP_PKEY_X25519, nullptr, private_key.data(), private_key.size()));
  PkeyPtr peer(EVP_PKEY_new_raw_public_key(EVP_PKEY_X25519, nullptr, peer_public_key.data(), peer_public_key.size()));
  if (!mine || !peer) return OpenSslError("X25519 key import");
  PkeyCtxPtr ctx(EVP_PKEY_CTX_new(mine.get(), nullptr));
  Key32 secret{};
  size_t length = secret.size();
  if (!ctx || EVP_PKEY_derive_init(ctx.get()) != 1 || EVP_PKEY_derive_set_peer(ctx.get(), peer.get()) != 1 ||
      EVP_PKEY_derive(ctx.get(), secret.data(), &length) != 1 || length != secret.size()) {
    return InvalidArgument("secagg: X25519 with peer key {} failed (a key of small order?): {}",
                           Hex(peer_public_key), crypto::internal::TakeOpenSslErrors());
  }
  return secret;
}

Result<Key32> HkdfSha256(std::span<const uint8_t> secret, std::span<const uint8_t> salt,
                         std::span<const uint8_t> info) {
  KdfPtr kdf(EVP_KDF_fetch(nullptr, "HKDF", nullptr));
  if (!kdf) return OpenSslError("EVP_KDF_fetch(HKDF)");
  KdfCtxPtr ctx(EVP_KDF_CTX_new(kdf.get()));
  if (!ctx) return OpenSslError("EVP_KDF_CTX_new");
  char digest[] = "SHA256";
  // OSSL_PARAM wants non-const pointers; OpenSSL only reads them here.
  auto octets = [](const char* name, std::span<const uint8_t> bytes) {
    return OSSL_PARAM_construct_octet_string(name, const_cast<uint8_t*>(bytes.data()), bytes.size());
  };
  OSSL_PARAM params[5];
  size_t n = 0;
  params[n++] = OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, digest, 0);
  params[n++] = octets(OSSL_KDF_PARAM_KEY, secret);
  if (!salt.empty()) params[n++] = octets(OSSL_KDF_PARAM_SALT, salt);
  params[n++] = octets(OSSL_KDF_PARAM_INFO, info);
  params[n] = OSSL_PARAM_construct_end();
  Key32 out{};
  if (EVP_KDF_derive(ctx.get(), out.data(), out.size(), params) != 1) return OpenSslError("HKDF-SHA256");
  return out;
}

Result<Key32> AgreeRoundKey(const Key32& private_key, const Key32& peer_public_key, std::string_view label,
                            uint64_t round) {
  ESTUARY_ASSIGN_OR_RETURN(Key32 shared, X25519SharedSecret(private_key, peer_public_key));
  std::string info(label);
  info += '\0';  // so no label is a prefix of another's info
  internal::AppendBigEndian64(info, round);
  Result<Key32> key = HkdfSha256(shared, {},
                                 std::span(reinterpret_cast<const uint8_t*>(info.data()), info.size()));
  shared.fill(0);
  return key;
}

}  // namespace estuary::secagg
