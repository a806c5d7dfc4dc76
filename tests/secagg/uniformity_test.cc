// What one site's masked vector looks like to the server: indistinguishable
// from uniform. A chi-square test of bucket frequencies passes, at a fixed
// significance, for a masked all-zeros update (the most structured input
// there is) and for a masked real update, and fails for the same update
// unmasked. Every key is fixed, so the statistics are the same on every run.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "secagg/key_agreement.h"
#include "secagg/masking.h"
#include "secagg/prg.h"
#include "secagg/quantize.h"
#include "tests/secagg/test_util.h"

namespace estuary::secagg {
namespace {

using testing::CountingKey;

constexpr size_t kElements = 1'000'000;

// The chi-square critical value for `df` degrees of freedom at significance
// 0.001 (z = 3.0902), by the Wilson–Hilferty approximation (accurate to well
// under 1% at df = 255: 330.5 tabulated).
double ChiSquareCritical(double df) {
  const double z = 3.0902;
  const double a = 2.0 / (9.0 * df);
  return df * std::pow(1 - a + z * std::sqrt(a), 3);
}

// Chi-square statistic of the 256 bucket counts of the top 8 bits of each
// b-bit element (for b = 32 also of every byte).
double ChiSquareTopByte(const std::vector<uint32_t>& values, int bits) {
  std::vector<double> counts(256, 0);
  for (uint32_t v : values) counts[(v >> (bits - 8)) & 0xff] += 1;
  const double expected = double(values.size()) / 256;
  double chi = 0;
  for (double c : counts) chi += (c - expected) * (c - expected) / expected;
  return chi;
}

double ChiSquareAllBytes(const std::vector<uint32_t>& values) {
  std::vector<double> counts(256, 0);
  for (uint32_t v : values) {
    for (int shift = 0; shift < 32; shift += 8) counts[(v >> shift) & 0xff] += 1;
  }
  const double expected = 4.0 * double(values.size()) / 256;
  double chi = 0;
  for (double c : counts) chi += (c - expected) * (c - expected) / expected;
  return chi;
}

// Site 3 of a 10-site complete graph masks `values` in place.
void MaskAsSiteThree(std::vector<uint32_t>& values, int bits, bool with_self_mask = true) {
  std::vector<PeerPublicKey> peers;
  for (uint32_t v = 0; v < 10; ++v) {
    if (v == 3) continue;
    auto pair = X25519KeyPairFromPrivate(CountingKey(static_cast<uint8_t>(40 + v)));
    ASSERT_TRUE(pair.ok());
    peers.push_back({v, pair->public_key});
  }
  auto pairwise = PairwiseMaskKeys(3, CountingKey(43), peers, 5);
  ASSERT_TRUE(pairwise.ok());
  if (with_self_mask) {
    ASSERT_TRUE(MaskChunk(3, CountingKey(200), *pairwise, bits, 0, values).ok());
  } else {
    for (const PairwiseKey& pair : *pairwise) {
      ASSERT_TRUE(ApplyMask(pair.key, 0, bits, pair.neighbour > 3 ? MaskSign::kAdd : MaskSign::kSubtract, values).ok());
    }
  }
}

std::vector<uint32_t> QuantizedRealUpdate(int bits) {
  std::mt19937 data(7);
  std::normal_distribution<float> normal(0.0f, 1e-2f);  // |x|_2 ≈ 10: values of a few hundred steps
  std::vector<float> update(kElements);
  for (float& x : update) x = normal(data);
  // |q| <= 1 · 10 · 4096 + 1, within a 20-bit ring's signed range.
  auto q = Quantize(update, 1, {.bits = bits, .clip_norm = 10, .scale = 1 << 12}, CountingKey(9));
  EXPECT_TRUE(q.ok());
  return q.ok() ? *q : std::vector<uint32_t>{};
}

TEST(Uniformity, MaskedZerosPassAndUnmaskedUpdateFailsAt32Bits) {
  const double critical = ChiSquareCritical(255);
  EXPECT_NEAR(critical, 330.5, 2.0);

  std::vector<uint32_t> zeros(kElements, 0);
  MaskAsSiteThree(zeros, 32);
  const double masked_zeros = ChiSquareAllBytes(zeros);
  EXPECT_LT(masked_zeros, critical);
  EXPECT_LT(ChiSquareTopByte(zeros, 32), critical);

  const std::vector<uint32_t> update = QuantizedRealUpdate(32);
  const double unmasked = ChiSquareAllBytes(update);
  EXPECT_GT(unmasked, critical);
  EXPECT_GT(ChiSquareTopByte(update, 32), critical);
  std::vector<uint32_t> masked = update;
  MaskAsSiteThree(masked, 32);
  const double masked_update = ChiSquareAllBytes(masked);
  EXPECT_LT(masked_update, critical);
  // The statistics, for docs/SECAGG.md (--gtest_output=xml shows them).
  RecordProperty("chi_square_masked_zeros", std::to_string(masked_zeros));
  RecordProperty("chi_square_masked_update", std::to_string(masked_update));
  RecordProperty("chi_square_unmasked_update", std::to_string(unmasked));
}

TEST(Uniformity, MaskedZerosPassAndUnmaskedUpdateFailsAt20Bits) {
  const double critical = ChiSquareCritical(255);
  std::vector<uint32_t> zeros(kElements, 0);
  MaskAsSiteThree(zeros, 20);
  for (uint32_t v : zeros) ASSERT_LE(v, RingMask(20));
  EXPECT_LT(ChiSquareTopByte(zeros, 20), critical);
  const std::vector<uint32_t> update = QuantizedRealUpdate(20);
  EXPECT_GT(ChiSquareTopByte(update, 20), critical);
}

TEST(Uniformity, PairwiseMasksAloneAlsoHideTheUpdate) {
  // Without its self mask a site's vector is still uniform to the server;
  // the self mask is what keeps it hidden if the server later learns the
  // pairwise keys (a site wrongly reported as dropped).
  const double critical = ChiSquareCritical(255);
  std::vector<uint32_t> zeros(kElements, 0);
  MaskAsSiteThree(zeros, 32, /*with_self_mask=*/false);
  EXPECT_LT(ChiSquareAllBytes(zeros), critical);
}

}  // namespace
}  // namespace estuary::secagg
