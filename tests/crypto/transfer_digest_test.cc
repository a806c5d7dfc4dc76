// The transfer digest against xxHash's own command-line tool (xxhsum -H2,
// xxHash 0.8.1, which writes XXH3-128 high half first), and the property the
// chunked transfers rely on: the digest of a stream does not depend on how
// it was cut.
#include "crypto/transfer_digest.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace estuary::crypto {
namespace {

// (i * 7 + 3) mod 256 for i in [0, n): long enough to cross XXH3's 1 KiB
// stripes and 64-byte blocks at many cuts.
std::vector<uint8_t> Pattern(size_t n) {
  std::vector<uint8_t> bytes(n);
  for (size_t i = 0; i < n; ++i) bytes[i] = uint8_t((i * 7 + 3) % 256);
  return bytes;
}

TEST(TransferDigest, MatchesXxhsum) {
  // printf '' | xxhsum -H2; printf abc | xxhsum -H2; and the pattern's
  // 1,000,003 bytes written to a file.
  EXPECT_EQ(TransferDigestHex("", 0), "99aa06d3014798d86001c324468d497f");
  EXPECT_EQ(TransferDigestHex("abc", 3), "06b05ab6733a618578af5f94892f3950");
  const std::vector<uint8_t> pattern = Pattern(1'000'003);
  EXPECT_EQ(TransferDigestHex(pattern.data(), pattern.size()), "dbe0cd4f15fc27026fb4080543f32e5b");
  EXPECT_EQ(TransferDigestHex("", 0).size(), kTransferDigestHexDigits);
}

TEST(TransferDigest, AStreamCutAnywhereDigestsAsOneRange) {
  const std::vector<uint8_t> pattern = Pattern(1'000'003);
  const std::string whole = TransferDigestHex(pattern.data(), pattern.size());
  for (size_t cut : {1, 63, 64, 65, 1024, 4096, 65'536, 1 << 20}) {
    TransferDigest digest;
    for (size_t at = 0; at < pattern.size(); at += cut) {
      digest.Update(pattern.data() + at, std::min(cut, pattern.size() - at));
    }
    EXPECT_EQ(digest.FinalHex(), whole) << "cut every " << cut << " bytes";
  }
  TransferDigest with_empty_updates;
  with_empty_updates.Update(pattern.data(), 0);
  with_empty_updates.Update(pattern.data(), pattern.size());
  with_empty_updates.Update(nullptr, 0);
  EXPECT_EQ(with_empty_updates.FinalHex(), whole);
}

TEST(TransferDigest, OneFlippedBitOrAMovedByteChangesIt) {
  std::vector<uint8_t> pattern = Pattern(100'000);
  const std::string before = TransferDigestHex(pattern.data(), pattern.size());
  pattern[54'321] ^= 0x10;
  EXPECT_NE(TransferDigestHex(pattern.data(), pattern.size()), before);
  pattern[54'321] ^= 0x10;
  std::swap(pattern[10], pattern[11]);  // the same bytes, two of them in each other's place
  EXPECT_NE(TransferDigestHex(pattern.data(), pattern.size()), before);
}

}  // namespace
}  // namespace estuary::crypto
