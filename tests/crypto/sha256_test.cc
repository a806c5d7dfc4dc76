#include "crypto/sha256.h"

#include <gtest/gtest.h>

#include <cctype>
#include <string>

namespace estuary::crypto {
namespace {

// FIPS 180-2 / NIST CSHA256 known answers.
TEST(Sha256, KnownAnswerAbc) {
  EXPECT_EQ(Sha256Hex("abc", 3), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Sha256, KnownAnswerEmpty) {
  EXPECT_EQ(Sha256Hex("", 0), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(Sha256, KnownAnswerTwoBlocks) {
  const std::string message = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  EXPECT_EQ(Sha256Hex(message.data(), message.size()),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST(Sha256, IncrementalEqualsOneShot) {
  std::string message(100000, '\0');
  for (size_t i = 0; i < message.size(); ++i) message[i] = static_cast<char>(i * 31 + 7);
  Sha256 hasher;
  for (size_t offset = 0; offset < message.size(); offset += 997) {
    hasher.Update(message.data() + offset, std::min<size_t>(997, message.size() - offset));
  }
  const auto digest = hasher.Final();
  EXPECT_EQ(ToHex(digest), Sha256Hex(message.data(), message.size()));
}

TEST(Sha256, DigestsCompareInEitherCase) {
  const std::string digest = Sha256Hex("abc", 3);
  std::string upper = digest;
  for (char& c : upper) c = char(std::toupper(static_cast<unsigned char>(c)));
  ASSERT_NE(upper, digest);
  EXPECT_TRUE(SameHexDigest(digest, upper));
  EXPECT_TRUE(SameHexDigest(upper, digest));
  EXPECT_TRUE(SameHexDigest("00Ff", "00fF"));
  EXPECT_FALSE(SameHexDigest(digest, Sha256Hex("abd", 3)));
  EXPECT_FALSE(SameHexDigest(digest, digest.substr(1)));
  EXPECT_FALSE(SameHexDigest("0g", "0G")) << "only hex digits fold";
  EXPECT_FALSE(SameHexDigest("", "a"));
}

TEST(Sha256, ToHexIsLowercase) {
  const uint8_t bytes[] = {0x00, 0x0f, 0xa0, 0xff};
  EXPECT_EQ(ToHex(bytes), "000fa0ff");
  EXPECT_EQ(ToHex({}), "");
}

}  // namespace
}  // namespace estuary::crypto
