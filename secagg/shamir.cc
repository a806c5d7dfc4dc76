#include "secagg/shamir.h"
#include "crypto/openssl_util.h"

#include <openssl/bn.h>
#include <openssl/evp.h>

#include <algorithm>
#include <memory>
#include <set>
#include <span>
#include <string_view>
#include <vector>

namespace estuary::secagg {
namespace {

struct BnFree {
  void operator()(BIGNUM* bn) const { BN_clear_free(bn); }
};
struct BnCtxFree {
  void operator()(BN_CTX* ctx) const { BN_CTX_free(ctx); }
};
using Bn = std::unique_ptr<BIGNUM, BnFree>;
using BnCtx = std::unique_ptr<BN_CTX, BnCtxFree>;

constexpr std::string_view kCommitmentLabel = "estuary secagg shamir v1";

// One field: p, a context, and the scratch every operation needs. Every
// BIGNUM call is checked; the first failure is kept and reported once.
class Field {
 public:
  Field() : ctx_(BN_CTX_secure_new()), p_(BN_new()) {
    ok_ = ctx_ && p_ && BN_set_bit(p_.get(), 521) == 1 && BN_sub_word(p_.get(), 1) == 1;
  }
  bool ok() const { return ok_; }
  const BIGNUM* p() const { return p_.get(); }
  BN_CTX* ctx() const { return ctx_.get(); }
  Bn New() {
    Bn bn(BN_secure_new());
    if (!bn) ok_ = false;
    return bn;
  }
  void Check(int rc) { ok_ = ok_ && rc == 1; }
  Status Error(std::string_view what) const {
    return Internal("secagg: shamir: {} failed: {}", what, crypto::internal::TakeOpenSslErrors());
  }

 private:
  BnCtx ctx_;
  Bn p_;
  bool ok_ = false;
};

// The distinct nonzero x of `shares`, or the first offender named.
Status CheckCoordinates(std::span<const Share> shares) {
  std::set<uint32_t> seen;
  for (const Share& share : shares) {
    if (share.x == 0) return InvalidArgument("secagg: shamir: share x = 0: f(0) is the secret, x must be nonzero");
    if (!seen.insert(share.x).second) return InvalidArgument("secagg: shamir: share x = {} appears twice", share.x);
  }
  return Status::Ok();
}

// Π of `factors` mod p, each a difference of two share coordinates (|f| <
// 2^32). The factors are gathered in a machine word while their product
// fits, and only the word touches the BIGNUM (BN_mul_word), which is reduced
// once it passes twice p's size: a small-integer product costs a fraction of
// a 521-bit modular multiplication.
void ProductOfDifferences(Field& field, std::span<const int64_t> factors, BIGNUM* out) {
  field.Check(BN_one(out));
  bool negative = false;
  uint64_t word = 1;
  for (int64_t factor : factors) {
    negative ^= factor < 0;
    const uint64_t magnitude = uint64_t(factor < 0 ? -factor : factor);
    uint64_t product = 0;
    if (!__builtin_mul_overflow(word, magnitude, &product)) {
      word = product;
      continue;
    }
    field.Check(BN_mul_word(out, word));
    if (BN_num_bits(out) > 1042) field.Check(BN_nnmod(out, out, field.p(), field.ctx()));
    word = magnitude;
  }
  field.Check(BN_mul_word(out, word));
  field.Check(BN_nnmod(out, out, field.p(), field.ctx()));
  if (negative && !BN_is_zero(out)) field.Check(BN_sub(out, field.p(), out));
}

// Σ_i y_i · Π_{j≠i} (at − x_j) / (x_i − x_j) mod p over `shares`. Each
// numerator and denominator is a product of small integers
// (ProductOfDifferences); the denominators are inverted together with one
// modular inverse (Montgomery's trick: prefix products, one inverse, and
// back), where inverting each would cost t inverses, the bulk of the work.
Status Interpolate(Field& field, std::span<const Share> shares, uint32_t at, BIGNUM* out) {
  const size_t t = shares.size();
  std::vector<Bn> ys, numerators, denominators, prefix;
  for (size_t i = 0; i < t; ++i) {
    ys.push_back(field.New());
    numerators.push_back(field.New());
    denominators.push_back(field.New());
    prefix.push_back(field.New());
  }
  Bn inverse = field.New(), term = field.New();
  if (!field.ok()) return field.Error("BN_new");
  for (size_t i = 0; i < t; ++i) {
    if (BN_bin2bn(shares[i].y.data(), kShareValueBytes, ys[i].get()) == nullptr) return field.Error("BN_bin2bn");
    if (BN_cmp(ys[i].get(), field.p()) >= 0) {
      return InvalidArgument("secagg: shamir: share x = {}: y is not a field element (>= 2^521 - 1)", shares[i].x);
    }
  }
  std::vector<int64_t> to_at, to_x;
  for (size_t i = 0; i < t; ++i) {
    to_at.clear();
    to_x.clear();
    for (size_t j = 0; j < t; ++j) {
      if (j == i) continue;
      to_at.push_back(int64_t(at) - int64_t(shares[j].x));
      to_x.push_back(int64_t(shares[i].x) - int64_t(shares[j].x));
    }
    ProductOfDifferences(field, to_at, numerators[i].get());
    // x_i ≠ x_j for all j ≠ i, and |x_i − x_j| < 2^32 < p, so the
    // denominator is nonzero mod p and has an inverse.
    ProductOfDifferences(field, to_x, denominators[i].get());
    field.Check(i == 0 ? BN_copy(prefix[0].get(), denominators[0].get()) != nullptr
                       : BN_mod_mul(prefix[i].get(), prefix[i - 1].get(), denominators[i].get(), field.p(),
                                    field.ctx()));
  }
  if (!field.ok()) return field.Error("interpolation");
  if (BN_mod_inverse(inverse.get(), prefix[t - 1].get(), field.p(), field.ctx()) == nullptr) {
    return field.Error("BN_mod_inverse");
  }
  BN_zero(out);
  // Down from the last: inverse holds (d_0 ⋯ d_i)^−1, so d_i^−1 = inverse · (d_0 ⋯ d_{i−1}).
  for (size_t i = t; i-- > 0 && field.ok();) {
    if (i > 0) {
      field.Check(BN_mod_mul(term.get(), inverse.get(), prefix[i - 1].get(), field.p(), field.ctx()));
      field.Check(BN_mod_mul(inverse.get(), inverse.get(), denominators[i].get(), field.p(), field.ctx()));
    } else {
      field.Check(BN_copy(term.get(), inverse.get()) != nullptr);
    }
    field.Check(BN_mod_mul(term.get(), term.get(), numerators[i].get(), field.p(), field.ctx()));
    field.Check(BN_mod_mul(term.get(), term.get(), ys[i].get(), field.p(), field.ctx()));
    field.Check(BN_mod_add(out, out, term.get(), field.p(), field.ctx()));
  }
  return field.ok() ? Status::Ok() : field.Error("interpolation");
}

}  // namespace

Commitment CommitToSecret(const Key32& secret) {
  Commitment digest{};
  unsigned int length = 0;
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  const bool ok = ctx != nullptr && EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr) == 1 &&
                  EVP_DigestUpdate(ctx, kCommitmentLabel.data(), kCommitmentLabel.size()) == 1 &&
                  EVP_DigestUpdate(ctx, secret.data(), secret.size()) == 1 &&
                  EVP_DigestFinal_ex(ctx, digest.data(), &length) == 1;
  EVP_MD_CTX_free(ctx);
  // SHA-256 over memory cannot fail short of an allocation failure; an
  // all-zero commitment then matches no secret, so Combine refuses safely.
  if (!ok || length != digest.size()) digest.fill(0);
  return digest;
}

Result<SharedSecret> Split(const Key32& secret, int threshold, std::span<const uint32_t> xs) {
  if (threshold < 1 || static_cast<size_t>(threshold) > xs.size()) {
    return InvalidArgument("secagg: shamir: threshold {} with {} holders: need 1 <= threshold <= holders", threshold,
                           xs.size());
  }
  std::vector<Share> shares(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) shares[i].x = xs[i];
  ESTUARY_RETURN_IF_ERROR(CheckCoordinates(shares));

  Field field;
  if (!field.ok()) return field.Error("field set-up");
  // coefficients[0] = secret, the rest uniform in [0, p).
  std::vector<Bn> coefficients;
  for (int i = 0; i < threshold; ++i) coefficients.push_back(field.New());
  if (!field.ok()) return field.Error("BN_new");
  if (BN_bin2bn(secret.data(), static_cast<int>(secret.size()), coefficients[0].get()) == nullptr) {
    return field.Error("BN_bin2bn");
  }
  for (int i = 1; i < threshold; ++i) field.Check(BN_priv_rand_range(coefficients[i].get(), field.p()));
  if (!field.ok()) return field.Error("BN_priv_rand_range");

  Bn x = field.New(), value = field.New();
  for (Share& share : shares) {
    // Horner: f(x) = (((c_{t-1} x + c_{t-2}) x + ...) x + c_0).
    field.Check(BN_set_word(x.get(), share.x));
    field.Check(BN_copy(value.get(), coefficients.back().get()) != nullptr);
    for (int i = threshold - 2; i >= 0; --i) {
      field.Check(BN_mod_mul(value.get(), value.get(), x.get(), field.p(), field.ctx()));
      field.Check(BN_mod_add(value.get(), value.get(), coefficients[i].get(), field.p(), field.ctx()));
    }
    field.Check(BN_bn2binpad(value.get(), share.y.data(), kShareValueBytes) == kShareValueBytes);
    if (!field.ok()) return field.Error("share evaluation");
  }
  return SharedSecret{std::move(shares), CommitToSecret(secret)};
}

Result<std::array<uint8_t, kShareValueBytes>> InterpolateAtZero(std::span<const Share> shares) {
  if (shares.empty()) return InvalidArgument("secagg: shamir: no shares to interpolate");
  ESTUARY_RETURN_IF_ERROR(CheckCoordinates(shares));
  Field field;
  Bn value = field.New();
  if (!field.ok()) return field.Error("field set-up");
  ESTUARY_RETURN_IF_ERROR(Interpolate(field, shares, 0, value.get()));
  std::array<uint8_t, kShareValueBytes> out{};
  if (BN_bn2binpad(value.get(), out.data(), kShareValueBytes) != kShareValueBytes) return field.Error("BN_bn2binpad");
  return out;
}

Result<Key32> Combine(std::span<const Share> shares, int threshold, const Commitment& commitment) {
  if (threshold < 1) return InvalidArgument("secagg: shamir: threshold {}: must be >= 1", threshold);
  if (shares.size() < static_cast<size_t>(threshold)) {
    return FailedPrecondition("secagg: shamir: {} shares with threshold {}: too few to reconstruct", shares.size(),
                              threshold);
  }
  ESTUARY_RETURN_IF_ERROR(CheckCoordinates(shares));
  Field field;
  Bn value = field.New(), check = field.New();
  if (!field.ok()) return field.Error("field set-up");
  const std::span<const Share> basis = shares.first(threshold);
  // Shares beyond the first t must lie on the same polynomial.
  for (const Share& extra : shares.subspan(threshold)) {
    ESTUARY_RETURN_IF_ERROR(Interpolate(field, basis, extra.x, check.get()));
    std::array<uint8_t, kShareValueBytes> expected{};
    if (BN_bn2binpad(check.get(), expected.data(), kShareValueBytes) != kShareValueBytes) {
      return field.Error("BN_bn2binpad");
    }
    if (expected != extra.y) {
      return InvalidArgument("secagg: shamir: share x = {} does not lie on the polynomial of the first {} shares: "
                             "a share was tampered with",
                             extra.x, threshold);
    }
  }
  ESTUARY_RETURN_IF_ERROR(Interpolate(field, basis, 0, value.get()));
  if (BN_num_bits(value.get()) > 256) {
    return InvalidArgument("secagg: shamir: the shares give a {}-bit value, not a 32-byte secret: a share was "
                           "tampered with or belongs to another secret",
                           BN_num_bits(value.get()));
  }
  Key32 secret{};
  if (BN_bn2binpad(value.get(), secret.data(), static_cast<int>(secret.size())) != 32) return field.Error("BN_bn2binpad");
  if (CommitToSecret(secret) != commitment) {
    secret.fill(0);
    return InvalidArgument("secagg: shamir: the reconstructed secret does not match its commitment: a share was "
                           "tampered with or belongs to another secret");
  }
  return secret;
}

}  // namespace estuary::secagg
