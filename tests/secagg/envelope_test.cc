#include "secagg/envelope.h"

#include <gtest/gtest.h>

#include "tests/secagg/test_util.h"

namespace estuary::secagg {
namespace {

const std::vector<uint8_t> kPlaintext = {'s', 'h', 'a', 'r', 'e', 0, 1, 2, 3, 255};
constexpr EnvelopeContext kContext{.sender = 3, .receiver = 9, .round = 42};

TEST(Envelope, RoundTrip) {
  const Key32 key = testing::CountingKey(1);
  auto sealed = Seal(key, kContext, kPlaintext);
  ASSERT_TRUE(sealed.ok()) << sealed.status().ToString();
  EXPECT_EQ(sealed->size(), kEnvelopeNonceBytes + kPlaintext.size() + kEnvelopeTagBytes);
  // The plaintext does not appear in the clear.
  EXPECT_EQ(std::search(sealed->begin(), sealed->end(), kPlaintext.begin(), kPlaintext.begin() + 5), sealed->end());
  auto opened = Open(key, kContext, *sealed);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  EXPECT_EQ(*opened, kPlaintext);
  // Empty plaintexts round-trip too.
  auto empty = Seal(key, kContext, {});
  ASSERT_TRUE(empty.ok());
  auto empty_opened = Open(key, kContext, *empty);
  ASSERT_TRUE(empty_opened.ok());
  EXPECT_TRUE(empty_opened->empty());
}

TEST(Envelope, FreshNonceEachSeal) {
  const Key32 key = testing::CountingKey(1);
  auto a = Seal(key, kContext, kPlaintext);
  auto b = Seal(key, kContext, kPlaintext);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
}

TEST(Envelope, EveryChangedByteFailsTheTag) {
  const Key32 key = testing::CountingKey(1);
  auto sealed = Seal(key, kContext, kPlaintext);
  ASSERT_TRUE(sealed.ok());
  for (size_t i = 0; i < sealed->size(); ++i) {
    std::vector<uint8_t> tampered = *sealed;
    tampered[i] ^= 0x80;
    auto opened = Open(key, kContext, tampered);
    ASSERT_FALSE(opened.ok()) << "byte " << i;
    EXPECT_EQ(opened.status().code(), Code::kInvalidArgument);
  }
  std::vector<uint8_t> truncated(sealed->begin(), sealed->end() - 1);
  EXPECT_FALSE(Open(key, kContext, truncated).ok());
  EXPECT_FALSE(Open(key, kContext, std::span(sealed->data(), 10)).ok());
}

TEST(Envelope, WrongContextOrKeyFailsTheTag) {
  const Key32 key = testing::CountingKey(1);
  auto sealed = Seal(key, kContext, kPlaintext);
  ASSERT_TRUE(sealed.ok());
  const EnvelopeContext swapped{.sender = 9, .receiver = 3, .round = 42};
  const EnvelopeContext other_round{.sender = 3, .receiver = 9, .round = 43};
  const EnvelopeContext other_receiver{.sender = 3, .receiver = 8, .round = 42};
  for (const EnvelopeContext& context : {swapped, other_round, other_receiver}) {
    auto opened = Open(key, context, *sealed);
    ASSERT_FALSE(opened.ok());
    EXPECT_NE(opened.status().message().find("tag does not verify"), std::string::npos)
        << opened.status().ToString();
  }
  EXPECT_FALSE(Open(testing::CountingKey(2), kContext, *sealed).ok());
}

}  // namespace
}  // namespace estuary::secagg
