#include "models/dot_forward.h"

#include <cstdint>
#include <cstdlib>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ESTUARY_DOT_FORWARD_X86 1
#endif

namespace estuary::models {

#ifdef ESTUARY_DOT_FORWARD_X86
namespace {

#define ESTUARY_AVX2 __attribute__((target("avx2,fma")))

ESTUARY_AVX2 inline float FoldLanes(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

// Rows [0, R) of x against rows [0, C) of w: R · C dot products over `in`.
// R · C accumulators and C rows of w stay in registers (2 · 5 + 5 + 1 = 16).
template <int R, int C>
ESTUARY_AVX2 void Block(const float* x, int in, const float* w, int out, const float* b, bool relu, float* y,
                        __m256i tail) {
  __m256 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  const int whole = in & ~7;
  for (int k = 0; k < whole; k += 8) {
    __m256 wv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + int64_t(c) * in + k);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + int64_t(r) * in + k);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  if (whole < in) {  // the last in % 8 elements; the masked lanes load as 0
    __m256 wv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) wv[c] = _mm256_maskload_ps(w + int64_t(c) * in + whole, tail);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_maskload_ps(x + int64_t(r) * in + whole, tail);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const float v = FoldLanes(acc[r][c]) + (b ? b[c] : 0.0f);
      y[int64_t(r) * out + c] = relu && !(v > 0.0f) ? 0.0f : v;
    }
  }
}

// Rows [0, C) of w against every row of x, two at a time. The C rows of w
// (15.7 KB for five of the MLP's fc1) stay in L1 while x's rows pass them;
// W, larger than L2 on the AVX2 EPYC, is read once a call.
template <int C>
ESTUARY_AVX2 void WRowsAgainstX(const float* x, int n, int in, const float* w, int out, const float* b, bool relu,
                                float* y, __m256i tail) {
  int i = 0;
  for (; i + 2 <= n; i += 2) Block<2, C>(x + int64_t(i) * in, in, w, out, b, relu, y + int64_t(i) * out, tail);
  if (i < n) Block<1, C>(x + int64_t(i) * in, in, w, out, b, relu, y + int64_t(i) * out, tail);
}

ESTUARY_AVX2 void DotForwardAvx2(const float* x, int n, int in, const float* w, int out, const float* b, bool relu,
                                 float* y) {
  alignas(32) int32_t lanes[8];
  for (int i = 0; i < 8; ++i) lanes[i] = i < (in & 7) ? -1 : 0;
  const __m256i tail = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  int o = 0;
  for (; o + 5 <= out; o += 5) {
    WRowsAgainstX<5>(x, n, in, w + int64_t(o) * in, out, b ? b + o : nullptr, relu, y + o, tail);
  }
  const float* wo = w + int64_t(o) * in;
  const float* bo = b ? b + o : nullptr;
  switch (out - o) {
    case 4: return WRowsAgainstX<4>(x, n, in, wo, out, bo, relu, y + o, tail);
    case 3: return WRowsAgainstX<3>(x, n, in, wo, out, bo, relu, y + o, tail);
    case 2: return WRowsAgainstX<2>(x, n, in, wo, out, bo, relu, y + o, tail);
    case 1: return WRowsAgainstX<1>(x, n, in, wo, out, bo, relu, y + o, tail);
    default: return;
  }
}

}  // namespace

#undef ESTUARY_AVX2

bool HaveDotForward() {
  static const bool have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return have;
}

void DotForward(const float* x, int n, int in, const float* w, int out, const float* b, bool relu, float* y) {
  DotForwardAvx2(x, n, in, w, out, b, relu, y);
}

#else  // not x86: no kernel, and Linear::Forward never calls it

bool HaveDotForward() { return false; }

void DotForward(const float*, int, int, const float*, int, const float*, bool, float*) { std::abort(); }

#endif

}  // namespace estuary::models
