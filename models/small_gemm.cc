#include "models/small_gemm.h"

#include <cblas.h>

#include <algorithm>
#include <cstdint>

#ifdef ESTUARY_HAVE_XSMM
#include <immintrin.h>
#include <libxsmm.h>
#endif

namespace estuary::models {

namespace {

void Blas(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
          int ldb, float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha,
              a, lda, b, ldb, beta, c, ldc);
}

// What libxsmm 1.17's JIT takes: alpha 1, beta 0 or 1, and (column-major)
// no transposed A, which is the row-major B.
bool XsmmCan(bool trans_b, float alpha, float beta) {
  return !trans_b && alpha == 1.0f && (beta == 0.0f || beta == 1.0f);
}

#ifdef ESTUARY_HAVE_XSMM

struct Shape {
  int m, n, k, lda, ldb, ldc;
  bool trans_a, beta_one;
  bool operator==(const Shape&) const = default;
};

// The kernel for a shape, generated on this thread's first call with it. The
// row-major C = op(A)·B is the column-major C' = B'·op(A)' of the same
// memory (X' the transpose), so libxsmm's A is our B and its B our A,
// transposed (its TRANS_B) when ours is. Null when libxsmm declines the shape.
libxsmm_smmfunction Kernel(const Shape& s) {
  struct Entry {
    Shape shape;
    libxsmm_smmfunction kernel;
  };
  constexpr int kSlots = 64;  // a model's layers at two or three batch sizes
  thread_local Entry table[kSlots];
  thread_local int used = 0;
  for (int i = 0; i < used; ++i) {
    if (table[i].shape == s) return table[i].kernel;
  }
  const int flags = s.trans_a ? LIBXSMM_GEMM_FLAG_TRANS_B : LIBXSMM_GEMM_FLAG_NONE;
  const int prefetch = LIBXSMM_PREFETCH_NONE;
  const float alpha = 1.0f, beta = s.beta_one ? 1.0f : 0.0f;
  const libxsmm_blasint lda = s.ldb, ldb = s.lda, ldc = s.ldc;
  const libxsmm_smmfunction kernel =
      libxsmm_smmdispatch(s.n, s.m, s.k, &lda, &ldb, &ldc, &alpha, &beta, &flags, &prefetch);
  // Past kSlots (many shapes on one thread) libxsmm's own registry still answers, more slowly.
  if (used < kSlots) table[used++] = {s, kernel};
  return kernel;
}

// libxsmm 1.17's kernels return with the upper halves of the vector
// registers dirty (they end without vzeroupper). The rest of the program is
// built for baseline x86-64, in legacy SSE encoding, and every such
// instruction after a dirty return pays for a merge with the upper state: the
// federated average after a round of kernels ran 5x slower. So each call ends
// with the vzeroupper that the kernel leaves out (where there is AVX to clear).
__attribute__((target("avx"))) void ZeroUpper() { _mm256_zeroupper(); }

// Runs the product on libxsmm if it takes it; false (nothing done) if not.
bool Xsmm(bool trans_a, int m, int n, int k, const float* a, int lda, const float* b, int ldb, float beta, float* c,
          int ldc) {
  const libxsmm_smmfunction kernel = Kernel({m, n, k, lda, ldb, ldc, trans_a, beta == 1.0f});
  if (!kernel) return false;
  kernel(b, a, c);
  static const bool have_avx = libxsmm_get_target_archid() >= LIBXSMM_X86_AVX;
  if (have_avx) ZeroUpper();
  return true;
}

#endif

}  // namespace

GemmEngine ChooseGemmEngine(bool /*trans_a*/, bool trans_b, int m, int n, int k, float alpha, float beta) {
  if (!HaveXsmm() || !XsmmCan(trans_b, alpha, beta)) return GemmEngine::kOpenBlas;
  const bool small = std::min({m, n, k}) <= kSmallGemmDim || int64_t(m) * n * k <= kSmallGemmVolume;
  return small ? GemmEngine::kXsmm : GemmEngine::kOpenBlas;
}

bool XsmmForwardPaysAtWidth(int lanes, int n, int in, int out) {
  const bool fills_vectors = lanes >= 16 || (lanes > 0 && n % lanes == 0);
  return fills_vectors && n <= kSmallGemmDim &&
         ChooseGemmEngine(false, false, out, n, in, 1.0f, 0.0f) == GemmEngine::kXsmm;
}

bool XsmmForwardPays(int n, int in, int out) {
#ifdef ESTUARY_HAVE_XSMM
  static const int lanes = libxsmm_get_target_archid() >= LIBXSMM_X86_AVX512 ? 16 : 8;
#else
  constexpr int lanes = 0;
#endif
  return XsmmForwardPaysAtWidth(lanes, n, in, out);
}

void SgemmOn(GemmEngine engine, bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
             const float* b, int ldb, float beta, float* c, int ldc) {
  if (m <= 0 || n <= 0) return;
#ifdef ESTUARY_HAVE_XSMM
  if (engine == GemmEngine::kXsmm && k > 0 && XsmmCan(trans_b, alpha, beta) &&
      Xsmm(trans_a, m, n, k, a, lda, b, ldb, beta, c, ldc)) {
    return;
  }
#else
  (void)engine;
#endif
  Blas(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void Sgemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
           int ldb, float beta, float* c, int ldc) {
  SgemmOn(ChooseGemmEngine(trans_a, trans_b, m, n, k, alpha, beta), trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb,
          beta, c, ldc);
}

bool HaveXsmm() {
#ifdef ESTUARY_HAVE_XSMM
  return true;
#else
  return false;
#endif
}

const char* XsmmTarget() {
#ifdef ESTUARY_HAVE_XSMM
  return libxsmm_get_target_arch();
#else
  return "none";
#endif
}

}  // namespace estuary::models
