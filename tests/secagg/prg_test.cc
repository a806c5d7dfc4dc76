#include "secagg/prg.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "tests/secagg/test_util.h"

namespace estuary::secagg {
namespace {

using testing::CountingKey;
using testing::FromHex;

std::string KeystreamHex(const Key32& key, const std::array<uint8_t, 12>& nonce, uint32_t counter, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  EXPECT_TRUE(ChaCha20Keystream(key, nonce, counter, out).ok());
  return Hex(std::string_view(reinterpret_cast<const char*>(out.data()), out.size()));
}

// RFC 8439 appendix A.1, test vectors #1 and #2: the all-zero key and nonce,
// block counters 0 and 1.
TEST(ChaCha20, Rfc8439AppendixA1) {
  EXPECT_EQ(KeystreamHex(Key32{}, {}, 0, 64),
            "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
            "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586");
  EXPECT_EQ(KeystreamHex(Key32{}, {}, 1, 64),
            "9f07e7be5551387a98ba977c732d080dcb0f29a048e3656912c6533e32ee7aed"
            "29b721769ce64e43d57133b074d839d531ed1f28510afb45ace10a1f4b794d6f");
}

// RFC 8439 section 2.4.2: the "sunscreen" encryption, key 00..1f, nonce
// 00 00 00 00 00 00 00 4a 00 00 00 00, initial counter 1.
TEST(ChaCha20, Rfc8439Section242) {
  const std::string plaintext =
      "Ladies and Gentlemen of the class of '99: If I could offer you only one tip for the future, sunscreen "
      "would be it.";
  std::array<uint8_t, 12> nonce{};
  nonce[7] = 0x4a;
  std::vector<uint8_t> keystream(plaintext.size());
  ASSERT_TRUE(ChaCha20Keystream(CountingKey(0), nonce, 1, keystream).ok());
  std::string ciphertext(plaintext.size(), '\0');
  for (size_t i = 0; i < plaintext.size(); ++i) ciphertext[i] = static_cast<char>(plaintext[i] ^ keystream[i]);
  EXPECT_EQ(Hex(ciphertext),
            "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b"
            "f91b65c5524733ab8f593dabcd62b3571639d624e65152ab8f530c359f0861d8"
            "07ca0dbf500d6a6156a38e088a22b65e52bc514d16ccf806818ce91ab7793736"
            "5af90bbf74a35be6b40b8eedf2785e42874d");
}

// The mask stream is that cipher: word i is keystream bytes 4i..4i+3,
// little-endian, with the block counter following the offset.
TEST(MaskStream, IsTheChaCha20KeystreamAsLittleEndianWords) {
  std::vector<uint32_t> words(32);
  ASSERT_TRUE(ExpandMask(Key32{}, 0, 32, words).ok());
  EXPECT_EQ(words[0], 0xade0b876u);   // 76 b8 e0 ad
  EXPECT_EQ(words[15], 0x8665eeb2u);  // b2 ee 65 86, the last word of block 0
  EXPECT_EQ(words[16], 0xbee7079fu);  // 9f 07 e7 be, block 1
  std::vector<uint32_t> from_block_one(1);
  ASSERT_TRUE(ExpandMask(Key32{}, 16, 32, from_block_one).ok());
  EXPECT_EQ(from_block_one[0], 0xbee7079fu);
  std::vector<uint32_t> twenty_bits(1);
  ASSERT_TRUE(ExpandMask(Key32{}, 0, 20, twenty_bits).ok());
  EXPECT_EQ(twenty_bits[0], 0xade0b876u & 0xfffffu);
}

TEST(MaskStream, DeterministicPerSeedAndDifferentAcrossSeeds) {
  std::vector<uint32_t> a(1000), b(1000), c(1000);
  ASSERT_TRUE(ExpandMask(CountingKey(1), 0, 32, a).ok());
  ASSERT_TRUE(ExpandMask(CountingKey(1), 0, 32, b).ok());
  ASSERT_TRUE(ExpandMask(CountingKey(2), 0, 32, c).ok());
  EXPECT_EQ(a, b);
  size_t equal = 0;
  for (size_t i = 0; i < a.size(); ++i) equal += a[i] == c[i];
  EXPECT_LT(equal, 3u);
}

TEST(MaskStream, ChunkedGenerationEqualsOneShot) {
  const size_t n = 10'000;
  for (int bits : {32, 20, 7}) {
    std::vector<uint32_t> whole(n);
    ASSERT_TRUE(ExpandMask(CountingKey(3), 0, bits, whole).ok());
    // Boundaries inside blocks, on blocks and across the internal 2048-word chunk.
    const std::vector<size_t> cuts = {0, 1, 7, 16, 17, 2047, 2048, 2049, 4111, 9999, n};
    std::vector<uint32_t> pieced(n);
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      ASSERT_TRUE(ExpandMask(CountingKey(3), cuts[i], bits, std::span(pieced).subspan(cuts[i], cuts[i + 1] - cuts[i]))
                      .ok());
    }
    EXPECT_EQ(pieced, whole) << bits << " bits";

    // Applying the mask chunk by chunk equals applying it at once.
    std::vector<uint32_t> values(n), chunked(n);
    for (size_t i = 0; i < n; ++i) values[i] = chunked[i] = static_cast<uint32_t>(i * 2654435761u) & RingMask(bits);
    ASSERT_TRUE(ApplyMask(CountingKey(3), 0, bits, MaskSign::kAdd, values).ok());
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      ASSERT_TRUE(ApplyMask(CountingKey(3), cuts[i], bits, MaskSign::kAdd,
                            std::span(chunked).subspan(cuts[i], cuts[i + 1] - cuts[i]))
                      .ok());
    }
    EXPECT_EQ(chunked, values);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(values[i], ((static_cast<uint32_t>(i * 2654435761u) & RingMask(bits)) + whole[i]) & RingMask(bits));
    }
    // Subtracting the same mask restores the input.
    ASSERT_TRUE(ApplyMask(CountingKey(3), 0, bits, MaskSign::kSubtract, values).ok());
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(values[i], static_cast<uint32_t>(i * 2654435761u) & RingMask(bits));
  }
}

TEST(MaskStream, SeveralMasksInOnePassEqualOneAtATime) {
  const Key32 a = CountingKey(10), b = CountingKey(20), c = CountingKey(30);
  const std::vector<SignedSeed> seeds = {{&a, MaskSign::kAdd}, {&b, MaskSign::kSubtract}, {&c, MaskSign::kAdd}};
  for (int bits : {32, 13}) {
    for (uint64_t offset : {uint64_t{0}, uint64_t{5}, uint64_t{4099}}) {
      std::vector<uint32_t> fused(5000), separate(5000);
      for (size_t i = 0; i < fused.size(); ++i) fused[i] = separate[i] = static_cast<uint32_t>(i * 7) & RingMask(bits);
      ASSERT_TRUE(ApplyMasks(seeds, offset, bits, fused).ok());
      for (const SignedSeed& s : seeds) ASSERT_TRUE(ApplyMask(*s.seed, offset, bits, s.sign, separate).ok());
      EXPECT_EQ(fused, separate) << bits << " bits, offset " << offset;
      std::vector<uint32_t> mask_a(5000);
      ASSERT_TRUE(ExpandMask(a, offset, bits, mask_a).ok());
      EXPECT_NE(fused[0], (uint32_t(0) + mask_a[0]) & RingMask(bits));  // b and c did contribute
    }
  }
}

TEST(MaskStream, TheLastBlockIsReachableAndBeyondIsRefused) {
  std::vector<uint32_t> last(16);
  EXPECT_TRUE(ExpandMask(CountingKey(4), kMaxStreamWords - 16, 32, last).ok());
  EXPECT_FALSE(ExpandMask(CountingKey(4), kMaxStreamWords - 15, 32, last).ok());
  EXPECT_FALSE(ExpandMask(CountingKey(4), 0, 0, last).ok());
  EXPECT_FALSE(ExpandMask(CountingKey(4), 0, 33, last).ok());
}

// A sanity check, not the proof: the mean of 10^6 elements of Z / 2^20 is
// within 5 standard errors of (2^20 − 1) / 2, and every one of the 20 bits is
// set about half the time.
TEST(MaskStream, StatisticalSanity) {
  const int bits = 20;
  const size_t n = 1'000'000;
  std::vector<uint32_t> words(n);
  ASSERT_TRUE(ExpandMask(CountingKey(5), 0, bits, words).ok());
  double sum = 0;
  std::vector<size_t> ones(bits, 0);
  uint32_t seen_or = 0;
  for (uint32_t w : words) {
    sum += w;
    seen_or |= w;
    for (int b = 0; b < bits; ++b) ones[b] += (w >> b) & 1;
  }
  EXPECT_EQ(seen_or, RingMask(bits));
  const double modulus = std::ldexp(1.0, bits);
  const double standard_error = modulus / std::sqrt(12.0 * n);
  EXPECT_NEAR(sum / n, (modulus - 1) / 2, 5 * standard_error);
  const double bit_error = 0.5 / std::sqrt(double(n));
  for (int b = 0; b < bits; ++b) EXPECT_NEAR(double(ones[b]) / n, 0.5, 5 * bit_error) << "bit " << b;
}

TEST(StreamWords, AreTheStreamsWordsInPairs) {
  std::vector<uint32_t> words(2000);
  ASSERT_TRUE(ExpandMask(CountingKey(6), 0, 32, words).ok());
  StreamWords stream(CountingKey(6));
  for (size_t i = 0; i < 1000; ++i) {
    auto next = stream.Next();
    ASSERT_TRUE(next.ok());
    ASSERT_EQ(*next, uint64_t{words[2 * i]} | (uint64_t{words[2 * i + 1]} << 32)) << i;
  }
}

}  // namespace
}  // namespace estuary::secagg
