// Single-precision matrix products of the CPU layers, behind one call.
//
// Sgemm computes what cblas_sgemm(CblasRowMajor, ...) computes with the same
// arguments: C[m, n] = alpha · op(A)[m, k] · op(B)[k, n] + beta · C. Each call
// goes to one of two engines:
//
//   libxsmm  a JIT kernel for the shape (AVX-512 or AVX2, as the CPU has),
//            when the shape is small in one dimension (at most
//            kSmallGemmDim: the batch of a client's SGD step) or small as a
//            whole (m·n·k at most kSmallGemmVolume: a convolution's product
//            for one image, whose operands fit in L2), alpha is 1,
//            beta is 0 or 1, and B is not transposed (libxsmm 1.17 cannot
//            transpose the row-major B). It packs nothing: at batch 10
//            OpenBLAS spends more time copying the weight matrix into its
//            panels than multiplying.
//   OpenBLAS everything else, and every shape in a build without libxsmm
//            (ESTUARY_HAVE_XSMM undefined: see CMakeLists.txt).
//
// The choice is a fixed rule of the arguments, never a timing, so a shape
// gets the same kernel, and so the same bits, in every run, on every thread.
// Kernels are generated once per shape and kept in a per-thread table: a call
// costs a lookup among a few entries, and allocates nothing.
#pragma once

#include <cstdint>

namespace estuary::models {

enum class GemmEngine { kOpenBlas, kXsmm };

// Largest smallest-dimension that goes to libxsmm (bench/small_gemm measures both engines).
inline constexpr int kSmallGemmDim = 32;
// Largest m·n·k that goes to libxsmm whatever its dimensions: 2^24, past the
// CNN's per-image products (64 × 196 × 800 ≈ 10^7), short of a classifier's
// layer at evaluation's batch of 500 (500 × 200 × 784 ≈ 7.8 · 10^7).
inline constexpr int64_t kSmallGemmVolume = int64_t(1) << 24;

// The engine Sgemm uses for these arguments.
GemmEngine ChooseGemmEngine(bool trans_a, bool trans_b, int m, int n, int k, float alpha, float beta);

// Whether a layer's y = x·Wᵀ (x [n, in], W [out, in]), which puts the
// transpose where libxsmm takes none, is formed as yᵀ = W·xᵀ on libxsmm, the
// layer transposing x and y, at a small batch n. The vector then runs along
// the batch. AVX-512's 16 lanes hold any batch up to 16 in one masked vector,
// and bench/small_gemm measured libxsmm 1.6-13x faster at 10 and 32 (with
// OPENBLAS_CORETYPE=Haswell): every small batch goes there. AVX2's 8 lanes
// hold a batch of 10 as a vector and a quarter, and on an AVX2-only EPYC the
// same bench measured the transposed forward at 0.49-0.62x OpenBLAS's
// y = x·Wᵀ at batch 10 and 0.88-1.6x at 20, but 1.0-2.5x at 8, 16 and 32
// (evaluation's batch): there it goes to libxsmm when the batch is a whole
// number of vectors. A fixed rule of the CPU and the shape, as the rest of
// the choice: a machine always picks the same kernel for a batch.
bool XsmmForwardPays(int n, int in, int out);
// The same rule for kernels of the given vector width in floats (16: AVX-512,
// 8: AVX2), whatever this CPU has.
bool XsmmForwardPaysAtWidth(int lanes, int n, int in, int out);

// As cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, ...).
void Sgemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
           int ldb, float beta, float* c, int ldc);

// The same on the given engine (for benchmarks and tests); kXsmm must be what
// ChooseGemmEngine would allow, except for the size rule.
void SgemmOn(GemmEngine engine, bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
             const float* b, int ldb, float beta, float* c, int ldc);

// Whether this build has libxsmm, and the instruction set its kernels use ("cpx", "hsw", ...; "none").
bool HaveXsmm();
const char* XsmmTarget();

}  // namespace estuary::models
