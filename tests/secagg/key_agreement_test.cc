#include "secagg/key_agreement.h"

#include <gtest/gtest.h>

#include "tests/secagg/test_util.h"

namespace estuary::secagg {
namespace {

using testing::KeyFromHex;

// RFC 7748 section 6.1.
constexpr char kAlicePrivate[] = "77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a";
constexpr char kAlicePublic[] = "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a";
constexpr char kBobPrivate[] = "5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb";
constexpr char kBobPublic[] = "de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f";
constexpr char kSharedSecret[] = "4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742";

TEST(X25519, Rfc7748KnownAnswer) {
  auto alice = X25519KeyPairFromPrivate(KeyFromHex(kAlicePrivate));
  auto bob = X25519KeyPairFromPrivate(KeyFromHex(kBobPrivate));
  ASSERT_TRUE(alice.ok() && bob.ok());
  EXPECT_EQ(Hex(alice->public_key), kAlicePublic);
  EXPECT_EQ(Hex(bob->public_key), kBobPublic);
  auto from_alice = X25519SharedSecret(alice->private_key, bob->public_key);
  auto from_bob = X25519SharedSecret(bob->private_key, alice->public_key);
  ASSERT_TRUE(from_alice.ok() && from_bob.ok());
  EXPECT_EQ(Hex(*from_alice), kSharedSecret);
  EXPECT_EQ(Hex(*from_bob), kSharedSecret);
}

// RFC 5869 appendix A.1 (SHA-256, 42 bytes of output; the first 32 here).
TEST(Hkdf, Rfc5869KnownAnswer) {
  const std::vector<uint8_t> ikm(22, 0x0b);
  const auto salt = testing::FromHex("000102030405060708090a0b0c");
  const auto info = testing::FromHex("f0f1f2f3f4f5f6f7f8f9");
  auto okm = HkdfSha256(ikm, salt, info);
  ASSERT_TRUE(okm.ok()) << okm.status().ToString();
  EXPECT_EQ(Hex(*okm), "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf");
}

TEST(AgreeRoundKey, BothSidesDeriveTheSameKey) {
  auto u = GenerateX25519KeyPair();
  auto v = GenerateX25519KeyPair();
  ASSERT_TRUE(u.ok() && v.ok());
  EXPECT_NE(u->private_key, v->private_key);
  auto at_u = AgreeRoundKey(u->private_key, v->public_key, kMaskKeyLabel, 7);
  auto at_v = AgreeRoundKey(v->private_key, u->public_key, kMaskKeyLabel, 7);
  ASSERT_TRUE(at_u.ok() && at_v.ok());
  EXPECT_EQ(*at_u, *at_v);
  // The key is HKDF's output, not the raw X25519 secret.
  auto raw = X25519SharedSecret(u->private_key, v->public_key);
  ASSERT_TRUE(raw.ok());
  EXPECT_NE(*at_u, *raw);
}

TEST(AgreeRoundKey, RoundsAndLabelsGiveIndependentKeys) {
  auto u = X25519KeyPairFromPrivate(KeyFromHex(kAlicePrivate));
  auto v = X25519KeyPairFromPrivate(KeyFromHex(kBobPrivate));
  ASSERT_TRUE(u.ok() && v.ok());
  auto mask7 = AgreeRoundKey(u->private_key, v->public_key, kMaskKeyLabel, 7);
  auto mask8 = AgreeRoundKey(u->private_key, v->public_key, kMaskKeyLabel, 8);
  auto share7 = AgreeRoundKey(u->private_key, v->public_key, kShareKeyLabel, 7);
  ASSERT_TRUE(mask7.ok() && mask8.ok() && share7.ok());
  EXPECT_NE(*mask7, *mask8);
  EXPECT_NE(*mask7, *share7);
  // Reproducible: the same pair, label and round give the same key.
  auto again = AgreeRoundKey(v->private_key, u->public_key, kMaskKeyLabel, 7);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *mask7);
  // And it is HKDF over the RFC's shared secret with our info layout.
  std::vector<uint8_t> info(kMaskKeyLabel.begin(), kMaskKeyLabel.end());
  info.push_back(0);
  for (int i = 0; i < 7; ++i) info.push_back(0);
  info.push_back(7);
  auto expected = HkdfSha256(KeyFromHex(kSharedSecret), {}, info);
  ASSERT_TRUE(expected.ok());
  EXPECT_EQ(*mask7, *expected);
}

TEST(AgreeRoundKey, AThirdPartyGetsAnotherKey) {
  auto u = GenerateX25519KeyPair();
  auto v = GenerateX25519KeyPair();
  auto w = GenerateX25519KeyPair();
  ASSERT_TRUE(u.ok() && v.ok() && w.ok());
  auto uv = AgreeRoundKey(u->private_key, v->public_key, kMaskKeyLabel, 1);
  auto wv = AgreeRoundKey(w->private_key, v->public_key, kMaskKeyLabel, 1);
  ASSERT_TRUE(uv.ok() && wv.ok());
  EXPECT_NE(*uv, *wv);
}

TEST(AgreeRoundKey, SmallOrderPeerKeyIsRefused) {
  // The all-zero public key (order 1) makes every shared secret zero.
  auto u = GenerateX25519KeyPair();
  ASSERT_TRUE(u.ok());
  auto key = AgreeRoundKey(u->private_key, Key32{}, kMaskKeyLabel, 1);
  ASSERT_FALSE(key.ok());
  EXPECT_EQ(key.status().message().find('\n'), std::string::npos);
}

}  // namespace
}  // namespace estuary::secagg
