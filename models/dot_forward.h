// A layer's forward at a small batch, y = x·Wᵀ + b (then ReLU where asked),
// as dot products of x's rows with W's rows, on AVX2 and FMA.
//
// Why: with the batch of 10 a client's SGD step runs, AVX2's 8 lanes cannot
// hold the batch (libxsmm's transposed forward runs at half OpenBLAS's rate,
// models/small_gemm.h), and OpenBLAS copies all of W into its panels on every
// call — 12 % of a one-thread flagship run on the AVX2 EPYC. Both operands are
// already rows of contiguous floats along `in`, which is what a dot product
// wants: the kernel keeps 2 rows of x against 5 rows of W in 10 accumulators,
// reads each operand once per block, packs nothing, and adds the bias and the
// ReLU as it stores.
//
// Every output is one dot product summed in a fixed order (8 lanes along
// `in`, the tail masked, then the lanes folded in a fixed tree), so the same
// arguments give the same bits on every call and every thread.
#pragma once

namespace estuary::models {

// Whether this CPU has AVX2 and FMA (DotForward must not run otherwise).
bool HaveDotForward();

// y [n, out] = x [n, in] · w [out, in]ᵀ + b [out] (b may be null), then
// max(0, ·) when relu. Row-major, rows contiguous; n, in, out >= 1.
void DotForward(const float* x, int n, int in, const float* w, int out, const float* b, bool relu, float* y);

}  // namespace estuary::models
