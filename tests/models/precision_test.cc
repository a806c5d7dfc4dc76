// models/precision against PyTorch: the bf16 and fp16 bit patterns that
// torch's .to() produces for specials, every fp16 value and the ties between
// them, bf16 ties and random bits (written by torch_precision.py, a ctest
// fixture), and torch's widening of all 65536 patterns of each format.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/precision.h"

namespace estuary::models {
namespace {

const nlohmann::json& Fixture() {
  static const nlohmann::json fixture = [] {
    const std::string path = std::string(ESTUARY_BINARY_DIR) + "/tests/models/precision/precision.json";
    std::ifstream in(path);
    EXPECT_TRUE(in.good()) << "missing " << path << " (the models_torch_precision step writes it)";
    return nlohmann::json::parse(in, nullptr, false);
  }();
  return fixture;
}

template <typename T>
std::vector<T> Bits(const char* key) {
  const auto& f = Fixture();
  if (f.is_discarded() || !f.contains(key)) return {};
  return f.at(key).get<std::vector<T>>();
}

bool IsBf16Nan(uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x007fu) != 0; }
bool IsF16Nan(uint16_t b) { return (b & 0x7c00u) == 0x7c00u && (b & 0x03ffu) != 0; }

// Narrowing: torch's bits exactly for every non-NaN input; for a NaN, a quiet
// NaN of the same sign (torch's own NaN bits differ between its code paths).
template <typename Convert, typename IsNan>
void CheckNarrowing(const char* key, Convert convert, IsNan is_nan, uint16_t quiet_bit) {
  const auto inputs = Bits<uint32_t>("f32");
  const auto expected = Bits<uint16_t>(key);
  ASSERT_FALSE(inputs.empty());
  ASSERT_EQ(inputs.size(), expected.size());
  int mismatches = 0, nans = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const float x = std::bit_cast<float>(inputs[i]);
    const uint16_t got = convert(x);
    if (std::isnan(x)) {
      ++nans;
      ASSERT_TRUE(is_nan(expected[i]));
      EXPECT_TRUE(is_nan(got) && (got & quiet_bit) && (got >> 15) == (inputs[i] >> 31))
          << fmt::format("{}: NaN 0x{:08x} became 0x{:04x}", key, inputs[i], got);
      continue;
    }
    if (got != expected[i] && ++mismatches <= 10) {
      ADD_FAILURE() << fmt::format("{}: 0x{:08x} ({}) -> 0x{:04x}, torch 0x{:04x}", key, inputs[i], x, got,
                                   expected[i]);
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << inputs.size() << " inputs";
  EXPECT_GT(nans, 0) << "the fixture must exercise NaN inputs";
}

TEST(Precision, FloatToBf16MatchesTorchBits) {
  CheckNarrowing("bf16", [](float x) { return FloatToBf16(x); }, IsBf16Nan, 0x0040);
}

TEST(Precision, FloatToF16MatchesTorchBits) {
  CheckNarrowing("f16", [](float x) { return FloatToF16(x); }, IsF16Nan, 0x0200);
}

// Widening is exact, NaNs included: compared bit for bit on all 65536 patterns.
template <typename Convert>
void CheckWidening(const char* key, Convert convert) {
  const auto expected = Bits<uint32_t>(key);
  ASSERT_EQ(expected.size(), 65536u);
  int mismatches = 0;
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint32_t got = std::bit_cast<uint32_t>(convert(uint16_t(b)));
    if (got != expected[b] && ++mismatches <= 10) {
      ADD_FAILURE() << fmt::format("{}: 0x{:04x} -> 0x{:08x}, torch 0x{:08x}", key, b, got, expected[b]);
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Precision, Bf16ToFloatMatchesTorchBits) {
  CheckWidening("bf16_to_f32", [](uint16_t b) { return Bf16ToFloat(b); });
}

TEST(Precision, F16ToFloatMatchesTorchBits) {
  CheckWidening("f16_to_f32", [](uint16_t b) { return F16ToFloat(b); });
}

TEST(Precision, RoundTripsAndSpanForms) {
  // Every non-NaN pattern survives widening then narrowing unchanged.
  for (uint32_t b = 0; b < 65536; ++b) {
    if (!IsBf16Nan(uint16_t(b))) {
      ASSERT_EQ(FloatToBf16(Bf16ToFloat(uint16_t(b))), b);
    }
    if (!IsF16Nan(uint16_t(b))) {
      ASSERT_EQ(FloatToF16(F16ToFloat(uint16_t(b))), b);
    }
  }
  const std::vector<float> x = {1.0f, -2.5f, 65504.0f, 1e-6f, INFINITY, -0.0f};
  std::vector<uint16_t> bf(x.size()), h(x.size());
  std::vector<float> back(x.size());
  FloatToBf16(x, bf);
  FloatToF16(x, h);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(bf[i], FloatToBf16(x[i]));
    EXPECT_EQ(h[i], FloatToF16(x[i]));
  }
  F16ToFloat(h, back);
  EXPECT_EQ(back[2], 65504.0f);
  EXPECT_EQ(back[3], 0x1.0p-24f * std::round(1e-6f / 0x1.0p-24f));  // 17 units: a subnormal fp16
  EXPECT_EQ(std::bit_cast<uint32_t>(back[5]), 0x80000000u);
  Bf16ToFloat(bf, back);
  EXPECT_EQ(back[1], -2.5f);
  EXPECT_TRUE(std::isinf(back[4]));
}

}  // namespace
}  // namespace estuary::models
