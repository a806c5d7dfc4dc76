#include "models/precision.h"

#include <bit>
#include <cassert>

namespace estuary::models {

uint16_t FloatToBf16(float value) {
  const uint32_t u = std::bit_cast<uint32_t>(value);
  // Setting the quiet bit keeps a NaN whose payload lives only in the low
  // half from truncating to the bits of infinity.
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);
  // Adding 0x7fff plus the lowest kept bit rounds to nearest, ties to even;
  // a carry out of the mantissa correctly bumps the exponent (up to inf).
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float Bf16ToFloat(uint16_t bits) { return std::bit_cast<float>(uint32_t(bits) << 16); }

uint16_t FloatToF16(float value) {
  const uint32_t u = std::bit_cast<uint32_t>(value);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x03ffu));
  // 65520 is halfway between 65504 (odd mantissa) and 2^16: from there up, inf.
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);
  if (a >= 0x38800000u) {  // a normal fp16 (>= 2^-14)
    a += 0x0fffu + ((a >> 13) & 1u);
    a -= uint32_t(127 - 15) << 23;
    return uint16_t(sign | (a >> 13));
  }
  // fp16 subnormals count units of 2^-24; value / 2^-24 = mantissa * 2^(exp - 126).
  const uint32_t exponent = a >> 23;
  const int shift = 126 - int(exponent);
  if (shift > 24) return sign;  // below 2^-25 (never a tie): rounds to zero
  const uint32_t mantissa = (a & 0x7fffffu) | 0x800000u;
  uint32_t q = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (q & 1u))) ++q;  // q == 1024 is 2^-14, the first normal
  return uint16_t(sign | q);
}

float F16ToFloat(uint16_t bits) {
  const uint32_t sign = uint32_t(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu, mantissa = bits & 0x03ffu;
  if (exponent == 0x1f) {
    // A NaN comes out quiet, payload kept, as F16C and the GPUs convert it (and torch with them).
    const uint32_t quiet = mantissa ? 0x00400000u : 0;
    return std::bit_cast<float>(sign | 0x7f800000u | quiet | (mantissa << 13));
  }
  if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
  // Subnormal (or zero): mantissa * 2^-24 is exact in fp32.
  const float magnitude = float(mantissa) * 0x1.0p-24f;
  return sign ? -magnitude : magnitude;
}

namespace {

// dst[i] = convert(src[i]), the spans of one size.
template <typename From, typename To>
void ConvertEach(std::span<const From> src, std::span<To> dst, To (*convert)(From)) {
  assert(src.size() == dst.size());
  for (size_t i = 0; i < src.size(); ++i) dst[i] = convert(src[i]);
}

}  // namespace

void FloatToBf16(std::span<const float> src, std::span<uint16_t> dst) { ConvertEach(src, dst, FloatToBf16); }
void Bf16ToFloat(std::span<const uint16_t> src, std::span<float> dst) { ConvertEach(src, dst, Bf16ToFloat); }
void FloatToF16(std::span<const float> src, std::span<uint16_t> dst) { ConvertEach(src, dst, FloatToF16); }
void F16ToFloat(std::span<const uint16_t> src, std::span<float> dst) { ConvertEach(src, dst, F16ToFloat); }

}  // namespace estuary::models
