// Low-precision floating point on the CPU: bfloat16 and IEEE binary16 (fp16)
// held as their uint16_t bit patterns, and conversions to and from fp32.
//
// Narrowing rounds to nearest, ties to even, bit for bit as PyTorch's
// .to(torch.bfloat16) and .to(torch.float16) do for every non-NaN input:
// values beyond the format's range become ±inf, tiny ones fp16 subnormals or
// ±0, and ±inf stay ±inf. A NaN stays a NaN of the same sign, made quiet, with
// the top bits of its payload (PyTorch itself returns different NaN bits on
// different code paths, so only NaN-ness is part of the comparison with it).
// Widening is exact (an fp16 NaN comes out quiet, as hardware converts it;
// a bf16 one keeps its bits). These are the references for the CUDA conversions in
// models/cuda/precision.h and the host side of mixed-precision tests.
#pragma once

#include <cstdint>
#include <span>

namespace estuary::models {

uint16_t FloatToBf16(float value);
float Bf16ToFloat(uint16_t bits);
uint16_t FloatToF16(float value);
float F16ToFloat(uint16_t bits);

// Elementwise over spans of equal length (asserted).
void FloatToBf16(std::span<const float> src, std::span<uint16_t> dst);
void Bf16ToFloat(std::span<const uint16_t> src, std::span<float> dst);
void FloatToF16(std::span<const float> src, std::span<uint16_t> dst);
void F16ToFloat(std::span<const uint16_t> src, std::span<float> dst);

}  // namespace estuary::models
