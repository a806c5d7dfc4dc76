#include "secagg/envelope.h"
#include "crypto/openssl_util.h"

#include <openssl/evp.h>
#include <openssl/rand.h>

#include <algorithm>
#include <memory>
#include <string>

namespace estuary::secagg {
namespace {

struct CipherCtxFree {
  void operator()(EVP_CIPHER_CTX* ctx) const { EVP_CIPHER_CTX_free(ctx); }
};
using CipherCtx = std::unique_ptr<EVP_CIPHER_CTX, CipherCtxFree>;

std::string AssociatedData(const EnvelopeContext& context) {
  std::string ad = "estuary secagg envelope v1";
  internal::AppendBigEndian32(ad, context.sender);
  internal::AppendBigEndian32(ad, context.receiver);
  internal::AppendBigEndian64(ad, context.round);
  return ad;
}

std::string Describe(const EnvelopeContext& context) {
  return fmt::format("envelope {} -> {} in round {}", context.sender, context.receiver, context.round);
}

}  // namespace

Result<std::vector<uint8_t>> Seal(const Key32& key, const EnvelopeContext& context,
                                  std::span<const uint8_t> plaintext) {
  if (plaintext.size() > (1u << 30)) return InvalidArgument("secagg: {}: {} bytes is too large", Describe(context), plaintext.size());
  std::vector<uint8_t> sealed(kEnvelopeNonceBytes + plaintext.size() + kEnvelopeTagBytes);
  if (RAND_bytes(sealed.data(), kEnvelopeNonceBytes) != 1) {
    return Internal("secagg: {}: RAND_bytes refused: {}", Describe(context), crypto::internal::TakeOpenSslErrors());
  }
  const std::string ad = AssociatedData(context);
  CipherCtx ctx(EVP_CIPHER_CTX_new());
  int length = 0, final_length = 0;
  const bool ok =
      ctx && EVP_EncryptInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr, nullptr, nullptr) == 1 &&
      EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_IVLEN, kEnvelopeNonceBytes, nullptr) == 1 &&
      EVP_EncryptInit_ex(ctx.get(), nullptr, nullptr, key.data(), sealed.data()) == 1 &&
      EVP_EncryptUpdate(ctx.get(), nullptr, &length, reinterpret_cast<const uint8_t*>(ad.data()),
                        static_cast<int>(ad.size())) == 1 &&
      EVP_EncryptUpdate(ctx.get(), sealed.data() + kEnvelopeNonceBytes, &length, plaintext.data(),
                        static_cast<int>(plaintext.size())) == 1 &&
      EVP_EncryptFinal_ex(ctx.get(), sealed.data() + kEnvelopeNonceBytes + length, &final_length) == 1 &&
      static_cast<size_t>(length + final_length) == plaintext.size() &&
      EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_GET_TAG, kEnvelopeTagBytes,
                          sealed.data() + kEnvelopeNonceBytes + plaintext.size()) == 1;
  if (!ok) return Internal("secagg: {}: AES-256-GCM seal failed: {}", Describe(context), crypto::internal::TakeOpenSslErrors());
  return sealed;
}

Result<std::vector<uint8_t>> Open(const Key32& key, const EnvelopeContext& context, std::span<const uint8_t> sealed) {
  if (sealed.size() < kEnvelopeNonceBytes + kEnvelopeTagBytes) {
    return InvalidArgument("secagg: {}: {} bytes is shorter than a nonce and a tag", Describe(context), sealed.size());
  }
  const size_t body = sealed.size() - kEnvelopeNonceBytes - kEnvelopeTagBytes;
  std::vector<uint8_t> plaintext(body);
  const std::string ad = AssociatedData(context);
  // EVP_CTRL_GCM_SET_TAG takes a non-const pointer but only copies from it.
  uint8_t tag[kEnvelopeTagBytes];
  std::copy_n(sealed.data() + kEnvelopeNonceBytes + body, kEnvelopeTagBytes, tag);
  CipherCtx ctx(EVP_CIPHER_CTX_new());
  int length = 0, final_length = 0;
  const bool set_up =
      ctx && EVP_DecryptInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr, nullptr, nullptr) == 1 &&
      EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_IVLEN, kEnvelopeNonceBytes, nullptr) == 1 &&
      EVP_DecryptInit_ex(ctx.get(), nullptr, nullptr, key.data(), sealed.data()) == 1 &&
      EVP_DecryptUpdate(ctx.get(), nullptr, &length, reinterpret_cast<const uint8_t*>(ad.data()),
                        static_cast<int>(ad.size())) == 1 &&
      EVP_DecryptUpdate(ctx.get(), plaintext.data(), &length, sealed.data() + kEnvelopeNonceBytes,
                        static_cast<int>(body)) == 1 &&
      EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_TAG, kEnvelopeTagBytes, tag) == 1;
  if (!set_up) return Internal("secagg: {}: AES-256-GCM open failed: {}", Describe(context), crypto::internal::TakeOpenSslErrors());
  if (EVP_DecryptFinal_ex(ctx.get(), plaintext.data() + length, &final_length) != 1) {
    std::fill(plaintext.begin(), plaintext.end(), 0);
    crypto::internal::TakeOpenSslErrors();  // a failed tag leaves no useful reason; clear the queue
    return InvalidArgument("secagg: {}: the tag does not verify: wrong key, sender, receiver or round, or "
                           "changed bytes",
                           Describe(context));
  }
  return plaintext;
}

}  // namespace estuary::secagg
