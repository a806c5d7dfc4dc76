#include "secagg/prg.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>

#include "tests/secagg/test_util.h"

namespace estuary::secagg {
namespace {

using testing::CountingKey;
using testing::FromHex;

// NIST SP 800-38A, appendix F.5.5 (CTR-AES256.Encrypt): four blocks from the
// counter block f0f1...feff, which carries into its last two bytes.
TEST(Aes256Ctr, NistSp80038aF55) {
  const Key32 key = testing::KeyFromHex("603deb1015ca71be2b73aef0857d77811f352c073b6108d72d9810a30914dff4");
  std::array<uint8_t, 16> counter{};
  for (int i = 0; i < 16; ++i) counter[i] = static_cast<uint8_t>(0xf0 + i);
  const std::vector<uint8_t> plaintext = FromHex(
      "6bc1bee22e409f96e93d7e117393172aae2d8a571e03ac9c9eb76fac45af8e51"
      "30c81c46a35ce411e5fbc1191a0a52eff69f2445df4f9b17ad2b417be66c3710");
  std::vector<uint8_t> keystream(plaintext.size());
  ASSERT_TRUE(Aes256CtrKeystream(key, counter, keystream).ok());
  std::string ciphertext(plaintext.size(), '\0');
  for (size_t i = 0; i < plaintext.size(); ++i) ciphertext[i] = static_cast<char>(plaintext[i] ^ keystream[i]);
  EXPECT_EQ(Hex(ciphertext),
            "601ec313775789a5b7a7f504bbf3d228f443e3ca4d62b59aca84e990cacaf5c5"
            "2b0930daa23de94ce87017ba2d84988ddfc9c58db67aada613c2dd08457941a6");
}

// The mask stream is that cipher from counter block 0: word i is keystream
// bytes 4i..4i+3, little-endian, with the counter following the offset. The
// zero key's first blocks, AES-256(0) = dc95c078..., AES-256(1) = 530f8afb....
TEST(MaskStream, IsTheAes256CtrKeystreamAsLittleEndianWords) {
  std::vector<uint32_t> words(8);
  ASSERT_TRUE(ExpandMask(Key32{}, 0, 32, words).ok());
  EXPECT_EQ(words[0], 0x78c095dcu);  // dc 95 c0 78
  EXPECT_EQ(words[3], 0x87208492u);  // 92 84 20 87, the last word of block 0
  EXPECT_EQ(words[4], 0xfb8a0f53u);  // 53 0f 8a fb, block 1
  std::vector<uint32_t> from_block_one(1);
  ASSERT_TRUE(ExpandMask(Key32{}, 4, 32, from_block_one).ok());
  EXPECT_EQ(from_block_one[0], 0xfb8a0f53u);
  std::vector<uint32_t> mid_block(1);
  ASSERT_TRUE(ExpandMask(Key32{}, 3, 32, mid_block).ok());
  EXPECT_EQ(mid_block[0], 0x87208492u);
  std::vector<uint32_t> twenty_bits(1);
  ASSERT_TRUE(ExpandMask(Key32{}, 0, 20, twenty_bits).ok());
  EXPECT_EQ(twenty_bits[0], 0x78c095dcu & 0xfffffu);
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
