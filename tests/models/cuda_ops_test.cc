// Every CUDA op of models/cuda against its CPU reference (models/), on fresh
// seeded random non-zero inputs, with each device output poisoned (NaN bytes)
// before the run so that an element the kernel forgets cannot pass.
//
// The metric is max|gpu - cpu| / max|cpu| over the whole output (a NaN
// anywhere fails it). Bounds: fp32 1e-5; TF32 3e-4 (inputs exactly
// representable in TF32) or the rigorous per-element rounding bound (any
// inputs); bf16 and fp16 1e-2; conversions bit for bit. The GPU tests skip
// with the reason when no usable device is present (CudaUsable()); the
// CudaCheck tests need no device and always run.
#include <cblas.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "models/cuda/blas.h"
#include "models/cuda/check.h"
#include "models/cuda/device.h"
#include "models/cuda/layers.h"
#include "models/cuda/optimizer.h"
#include "models/cuda/precision.h"
#include "models/layers.h"
#include "models/loss_scaler.h"
#include "models/optimizer.h"
#include "models/precision.h"

namespace estuary::models {
namespace {

using Values = std::vector<float>;

constexpr double kF32Tolerance = 1e-5;
constexpr double kTf32Tolerance = 3e-4;
constexpr double kLowPrecisionTolerance = 1e-2;

// max |a - b| / max |b|; infinite when a has a NaN or inf where b is finite.
double RelativeError(const Values& a, const Values& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0, scale = 1e-30;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const double d = std::abs(double(a[i]) - double(b[i]));
    if (!std::isfinite(d)) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, d);
    scale = std::max(scale, double(std::abs(b[i])));
  }
  return diff / scale;
}

// Uniform magnitudes in [0.1, 1) with random signs: no zeros, no denormals.
Values Random(size_t n, uint32_t seed, float magnitude = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.1f, 1.0f);
  Values v(n);
  for (float& x : v) x = (rng() & 1 ? 1.0f : -1.0f) * u(rng) * magnitude;
  return v;
}

TEST(CudaCheck, RuntimeErrorsBecomeStatusWithWhereAndWhat) {
  auto fails = []() -> Status {
    ESTUARY_CUDA_RETURN_IF_ERROR(cudaErrorMemoryAllocation);
    return Status::Ok();
  };
  const Status s = fails();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), Code::kInternal);
  const std::string& m = s.message();
  EXPECT_NE(m.find("cuda_ops_test.cc:"), std::string::npos) << m;
  EXPECT_NE(m.find("cudaErrorMemoryAllocation failed: cudaErrorMemoryAllocation"), std::string::npos) << m;
  EXPECT_NE(m.find("out of memory"), std::string::npos) << m;
  auto passes = []() -> Status {
    ESTUARY_CUDA_RETURN_IF_ERROR(cudaSuccess);
    return Status::Ok();
  };
  EXPECT_TRUE(passes().ok());
}

TEST(CudaCheck, CublasErrorsBecomeStatusWithWhereAndWhat) {
  auto fails = []() -> Status {
    ESTUARY_CUBLAS_RETURN_IF_ERROR(CUBLAS_STATUS_INVALID_VALUE);
    return Status::Ok();
  };
  const Status s = fails();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("cuda_ops_test.cc:"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("failed: CUBLAS_STATUS_INVALID_VALUE"), std::string::npos) << s.message();
}

TEST(CudaCheck, UsabilityIsReportedNotAborted) {
  // Runs everywhere: either a device is usable, or the reason says what failed.
  const Status s = cuda::CudaUsable();
  if (!s.ok()) {
    EXPECT_EQ(s.code(), Code::kFailedPrecondition);
    EXPECT_TRUE(s.message().starts_with("no CUDA device: ") || s.message().starts_with("CUDA device "))
        << s.message();
  } else {
    auto count = cuda::CudaDeviceCount();
    ASSERT_TRUE(count.ok()) << count.status().ToString();
    EXPECT_GE(*count, 1);
  }
}

// One stream, one cuBLAS handle and an arena per test; device buffers that
// live until the test ends; uploads and poisoned outputs.
class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (Status s = cuda::CudaUsable(); !s.ok()) GTEST_SKIP() << s.message();
    auto stream = cuda::Stream::Create();
    ASSERT_TRUE(stream.ok()) << stream.status().ToString();
    stream_ = std::move(*stream);
    auto blas = cuda::Blas::Create(stream_.get());
    ASSERT_TRUE(blas.ok()) << blas.status().ToString();
    blas_ = std::move(*blas);
    auto arena = cuda::Arena::Create(size_t(16) << 20);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    arena_ = std::move(*arena);
  }

  cudaStream_t s() const { return stream_.get(); }

  // `bytes` of device memory filled with 0xff: NaN as fp32, bf16 and fp16, -1 as int.
  void* Poisoned(size_t bytes) {
    auto buffer = cuda::DeviceBuffer::Allocate(std::max<size_t>(bytes, 1));
    EXPECT_TRUE(buffer.ok()) << buffer.status().ToString();
    if (!buffer.ok()) return nullptr;
    EXPECT_TRUE(cuda::FillBytes(buffer->data(), 0xff, buffer->size(), s()).ok());
    buffers_.push_back(std::move(*buffer));
    return buffers_.back().data();
  }
  template <typename T>
  T* Poisoned(size_t count) {
    return static_cast<T*>(Poisoned(count * sizeof(T)));
  }
  template <typename T>
  T* Upload(const std::vector<T>& host) {
    T* p = Poisoned<T>(host.size());
    EXPECT_TRUE(p && cuda::CopyToDevice(p, host.data(), host.size() * sizeof(T), s()).ok());
    return p;
  }
  template <typename T>
  std::vector<T> Download(const T* device, size_t count) {
    std::vector<T> host(count);
    const Status st = cuda::CopyToHost(host.data(), device, count * sizeof(T), s());
    EXPECT_TRUE(st.ok()) << st.ToString();
    return host;
  }
  Values Download(const float* device, size_t count) { return Download<float>(device, count); }

  cuda::Stream stream_;
  cuda::Blas blas_;
  cuda::Arena arena_;
  std::vector<cuda::DeviceBuffer> buffers_;
};

#define ASSERT_OK(expr)                                    \
  do {                                                     \
    const ::estuary::Status status_ = (expr);              \
    ASSERT_TRUE(status_.ok()) << status_.ToString();       \
  } while (0)

TEST_F(CudaOps, DeviceBufferArenaAndStream) {
  auto a = cuda::DeviceBuffer::Allocate(1000);
  ASSERT_TRUE(a.ok());
  void* p = a->data();
  cuda::DeviceBuffer b = std::move(*a);
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(b.size(), 1000u);
  EXPECT_EQ(a->data(), nullptr);

  auto arena = cuda::Arena::Create(4096);
  ASSERT_TRUE(arena.ok());
  auto x = arena->Allocate(10);
  auto y = arena->Allocate<double>(3);
  ASSERT_TRUE(x.ok() && y.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*x) % cuda::Arena::kAlignment, 0u);
  EXPECT_EQ(static_cast<char*>(static_cast<void*>(*y)) - static_cast<char*>(*x), 256);
  auto too_big = arena->Allocate(4096);
  ASSERT_FALSE(too_big.ok());
  EXPECT_NE(too_big.status().message().find("4096 bytes requested with 512 of 4096 in use"), std::string::npos)
      << too_big.status().message();
  arena->Reset();
  auto again = arena->Allocate(4096);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *x);
  EXPECT_EQ(arena->peak(), 4096u);

  // An error from the runtime surfaces as a Status and leaves the next call clean.
  auto huge = cuda::DeviceBuffer::Allocate(size_t(1) << 60);
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.status().message().find("cudaErrorMemoryAllocation"), std::string::npos);
  Values host = Random(64, 1);
  float* d = Upload(host);
  EXPECT_EQ(Download(d, host.size()), host);
  ASSERT_OK(stream_.Synchronize());
}

// ---- GEMM ------------------------------------------------------------------

struct GemmCase {
  bool ta, tb;
  int m, n, k;
  int pad;  // extra elements per stored row: leading dimensions beyond the minimum
};

// Row-major operands for op(A) [m, k] and op(B) [k, n] as stored.
struct GemmData {
  int lda, ldb, ldc;
  Values a, b, c;
};

GemmData MakeGemm(const GemmCase& g, uint32_t seed) {
  GemmData d;
  d.lda = (g.ta ? g.m : g.k) + g.pad;
  d.ldb = (g.tb ? g.k : g.n) + g.pad;
  d.ldc = g.n + g.pad;
  d.a = Random(size_t(g.ta ? g.k : g.m) * d.lda, seed);
  d.b = Random(size_t(g.tb ? g.n : g.k) * d.ldb, seed + 1);
  d.c = Random(size_t(g.m) * d.ldc, seed + 2);
  return d;
}

Values CpuGemm(const GemmCase& g, const GemmData& d, const Values& a, const Values& b, float alpha, float beta) {
  Values c = d.c;
  cblas_sgemm(CblasRowMajor, g.ta ? CblasTrans : CblasNoTrans, g.tb ? CblasTrans : CblasNoTrans, g.m, g.n, g.k,
              alpha, a.data(), d.lda, b.data(), d.ldb, beta, c.data(), d.ldc);
  return c;
}

const GemmCase kGemmCases[] = {{false, false, 37, 53, 71, 0}, {false, true, 37, 53, 71, 3},
                               {true, false, 64, 17, 129, 1}, {true, true, 5, 96, 33, 0}};

TEST_F(CudaOps, GemmF32MatchesCblasInEveryLayout) {
  uint32_t seed = 10;
  for (const GemmCase& g : kGemmCases) {
    GemmData d = MakeGemm(g, seed += 3);
    const float alpha = 0.75f, beta = -0.5f;
    float *a = Upload(d.a), *b = Upload(d.b), *c = Upload(d.c);
    ASSERT_OK(cuda::Gemm(blas_, g.ta, g.tb, g.m, g.n, g.k, alpha, a, d.lda, b, d.ldb, beta, c, d.ldc));
    // Without allow_tf32 this must be true fp32: TF32 would miss 1e-5 by an order of magnitude.
    EXPECT_LE(RelativeError(Download(c, d.c.size()), CpuGemm(g, d, d.a, d.b, alpha, beta)), kF32Tolerance)
        << g.ta << g.tb << " " << g.m << "x" << g.n << "x" << g.k;
  }
}

// TF32 keeps 10 mantissa bits. On inputs that already fit in them the result
// must meet 3e-4 (it is in fact fp32-accurate); on arbitrary inputs each
// element must stay within the rounding bound 2^-9 * sum|a||b| (truncation
// loses up to 2^-10 per input, so 2^-9 per product), plus fp32 accumulation.
TEST_F(CudaOps, GemmTf32OnlyWhenAskedAndWithinItsBound) {
  const GemmCase g{false, true, 48, 40, 96, 0};
  GemmData d = MakeGemm(g, 77);
  auto to_tf32 = [](Values v) {
    for (float& x : v) x = std::bit_cast<float>(std::bit_cast<uint32_t>(x) & 0xffffe000u);
    return v;
  };
  const Values a_exact = to_tf32(d.a), b_exact = to_tf32(d.b);
  const cuda::GemmTypes tf32{DType::kF32, DType::kF32, true};
  {
    float *a = Upload(a_exact), *b = Upload(b_exact), *c = Upload(d.c);
    ASSERT_OK(cuda::Gemm(blas_, g.ta, g.tb, g.m, g.n, g.k, 1.0f, a, d.lda, b, d.ldb, 1.0f, c, d.ldc, tf32));
    EXPECT_LE(RelativeError(Download(c, d.c.size()), CpuGemm(g, d, a_exact, b_exact, 1.0f, 1.0f)), kTf32Tolerance);
  }
  float *a = Upload(d.a), *b = Upload(d.b), *c = Poisoned<float>(d.c.size());
  ASSERT_OK(cuda::Gemm(blas_, g.ta, g.tb, g.m, g.n, g.k, 1.0f, a, d.lda, b, d.ldb, 0.0f, c, d.ldc, tf32));
  const Values got = Download(c, d.c.size());
  const Values want = CpuGemm(g, d, d.a, d.b, 1.0f, 0.0f);
  int violations = 0;
  for (int i = 0; i < g.m; ++i) {
    for (int j = 0; j < g.n; ++j) {
      double abs_sum = 0;
      for (int k = 0; k < g.k; ++k) {
        abs_sum += std::abs(double(d.a[size_t(i) * d.lda + k]) * d.b[size_t(j) * d.ldb + k]);
      }
      const double bound = (0x1.0p-9 + 0x1.0p-20 + 2 * g.k * 0x1.0p-24) * abs_sum;
      const double err = std::abs(double(got[size_t(i) * d.ldc + j]) - want[size_t(i) * d.ldc + j]);
      if (!(err <= bound) && ++violations <= 5) ADD_FAILURE() << i << "," << j << ": " << err << " > " << bound;
    }
  }
  EXPECT_EQ(violations, 0);
}

// bf16/fp16 inputs with fp32 accumulation. The reference is sgemm on the same
// rounded inputs (products of 8- or 11-bit mantissas are exact in fp32), so an
// fp32 output must meet the fp32 bound and a low-precision one 1e-2.
TEST_F(CudaOps, GemmLowPrecisionInputsAccumulateInF32) {
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    for (DType out : {DType::kF32, dtype}) {
      const GemmCase g{false, true, 33, 65, 130, 0};
      GemmData d = MakeGemm(g, 200 + int(dtype) * 10 + int(out));
      auto narrow = [&](const Values& v) {
        std::vector<uint16_t> bits(v.size());
        dtype == DType::kBF16 ? FloatToBf16(v, bits) : FloatToF16(v, bits);
        return bits;
      };
      auto widen = [&](const std::vector<uint16_t>& bits) {
        Values v(bits.size());
        dtype == DType::kBF16 ? Bf16ToFloat(bits, v) : F16ToFloat(bits, v);
        return v;
      };
      const auto a_bits = narrow(d.a), b_bits = narrow(d.b);
      const Values want = CpuGemm(g, d, widen(a_bits), widen(b_bits), 1.0f, 0.0f);
      uint16_t *a = Upload(a_bits), *b = Upload(b_bits);
      const size_t c_count = size_t(g.m) * d.ldc;
      void* c = Poisoned(c_count * DTypeSize(out));
      ASSERT_OK(cuda::Gemm(blas_, g.ta, g.tb, g.m, g.n, g.k, 1.0f, a, d.lda, b, d.ldb, 0.0f, c, d.ldc,
                           {dtype, out, false}));
      const Values got = out == DType::kF32 ? Download(static_cast<float*>(c), c_count)
                                            : widen(Download(static_cast<uint16_t*>(c), c_count));
      EXPECT_LE(RelativeError(got, want), out == DType::kF32 ? kF32Tolerance : kLowPrecisionTolerance)
          << DTypeName(dtype) << " -> " << DTypeName(out);
    }
  }
}

TEST_F(CudaOps, GemmRejectsBadArguments) {
  float* p = Poisoned<float>(64);
  auto bad = [&](int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, cuda::GemmTypes t = {}) {
    return cuda::Gemm(blas_, false, false, m, n, k, 1.0f, p, lda, p, ldb, 0.0f, p, ldc, t);
  };
  EXPECT_EQ(bad(-1, 4, 4, 4, 4, 4).code(), Code::kInvalidArgument);
  EXPECT_EQ(bad(4, 4, 4, 3, 4, 4).code(), Code::kInvalidArgument);  // lda < k
  EXPECT_EQ(bad(4, 4, 4, 4, 3, 4).code(), Code::kInvalidArgument);  // ldb < n
  EXPECT_EQ(bad(4, 4, 4, 4, 4, 3).code(), Code::kInvalidArgument);  // ldc < n
  EXPECT_EQ(bad(int64_t(1) << 31, 1, 1, 1, 1, 1).code(), Code::kInvalidArgument);
  EXPECT_EQ(bad(4, 4, 4, 4, 4, 4, {DType::kBF16, DType::kF16, false}).code(), Code::kInvalidArgument);
  EXPECT_EQ(bad(4, 4, 4, 4, 4, 4, {DType::kBF16, DType::kF32, true}).code(), Code::kInvalidArgument);
  const Status s = bad(4, 4, 4, 3, 4, 4);
  EXPECT_NE(s.message().find("lda=3"), std::string::npos) << s.message();
}

// ---- Mixed precision -----------------------------------------------------------

Values SpecialsAndRandom(size_t n, uint32_t seed) {
  Values v = Random(n, seed, 100.0f);
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, std::numeric_limits<float>::quiet_NaN(),
                            65504.0f, 65520.0f, 1e-7f, -3e-8f, 3.0e38f, 1.0f + 0x1.0p-8f, 1.0f + 0x1.0p-11f,
                            std::bit_cast<float>(0x3f808000u), std::bit_cast<float>(0x7f7fffffu)};
  for (size_t i = 0; i < std::size(specials) && i * 7 < n; ++i) v[i * 7] = specials[i];
  return v;
}

bool SameOrBothNan(float a, float b) {
  return std::isnan(a) ? std::isnan(b) : std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}

// Bit for bit against models/precision on every non-NaN value; NaN stays NaN.
// Odd counts and a misaligned start run the scalar tails as well as the vector body.
TEST_F(CudaOps, ConvertMatchesCpuBitsBothWays) {
  for (DType low : {DType::kBF16, DType::kF16}) {
    for (size_t offset : {0, 1}) {
      const size_t n = 100003;
      const Values x = SpecialsAndRandom(n + offset, 31 + uint32_t(offset));
      std::vector<uint16_t> want(n);
      auto narrow = [&](std::span<const float> in, std::span<uint16_t> out) {
        low == DType::kBF16 ? FloatToBf16(in, out) : FloatToF16(in, out);
      };
      narrow(std::span(x).subspan(offset), want);
      const float* src = Upload(x) + offset;
      uint16_t* dst = Poisoned<uint16_t>(n + offset) + offset;
      ASSERT_OK(cuda::Convert(src, DType::kF32, dst, low, int64_t(n), s()));
      const std::vector<uint16_t> got = Download<uint16_t>(dst, n);
      int mismatches = 0;
      for (size_t i = 0; i < n; ++i) {
        const float a = low == DType::kBF16 ? Bf16ToFloat(got[i]) : F16ToFloat(got[i]);
        const float b = low == DType::kBF16 ? Bf16ToFloat(want[i]) : F16ToFloat(want[i]);
        if (!SameOrBothNan(a, b) && ++mismatches <= 5) {
          ADD_FAILURE() << DTypeName(low) << " " << x[i + offset] << ": 0x" << std::hex << got[i] << " vs 0x"
                        << want[i];
        }
      }
      EXPECT_EQ(mismatches, 0);

      // And back: widening is exact.
      float* wide = Poisoned<float>(n + offset) + offset;
      ASSERT_OK(cuda::Convert(dst, low, wide, DType::kF32, int64_t(n), s()));
      const Values back = Download(wide, n);
      mismatches = 0;
      for (size_t i = 0; i < n; ++i) {
        const float b = low == DType::kBF16 ? Bf16ToFloat(want[i]) : F16ToFloat(want[i]);
        if (!SameOrBothNan(back[i], b) && ++mismatches <= 5) ADD_FAILURE() << i << ": " << back[i] << " vs " << b;
      }
      EXPECT_EQ(mismatches, 0);
    }
  }
  EXPECT_EQ(cuda::Convert(nullptr, DType::kF32, nullptr, DType::kF32, 4, s()).code(), Code::kInvalidArgument);
}

TEST_F(CudaOps, UnscaleMatchesCpuAndFlagsEveryKindOfNonFinite) {
  const size_t n = 65539;
  float* flag = Poisoned<float>(1);
  const float inv_scale = 1.0f / 65536.0f;
  for (float bad : {0.0f, INFINITY, -INFINITY, std::numeric_limits<float>::quiet_NaN()}) {
    for (size_t at : {size_t(0), n / 2, n - 1}) {  // the vector body and the scalar tail
      Values g = Random(n, 41, 65536.0f);
      if (bad != 0.0f) g[at] = bad;
      Values want = g;
      const bool cpu_found = UnscaleAndCheckFinite(want, inv_scale);
      float* d = Upload(g);
      ASSERT_OK(cuda::UnscaleAndCheckFinite(d, int64_t(n), inv_scale, flag, s()));
      auto found = cuda::ReadFoundInf(flag, s());
      ASSERT_TRUE(found.ok()) << found.status().ToString();
      EXPECT_EQ(*found, cpu_found) << bad << " at " << at;
      EXPECT_EQ(*found, bad != 0.0f);
      const Values got = Download(d, n);
      for (size_t i = 0; i < n; ++i) ASSERT_TRUE(SameOrBothNan(got[i], want[i])) << i;
    }
  }
}

// The CUDA mixed-precision step: unscale on the device, read the flag once,
// run the fused optimizer only when it is clear. A step with an injected inf
// leaves every weight bit, the moments and the working copy as they were.
TEST_F(CudaOps, LossScalerSkipsTheDeviceStepOnOverflow) {
  const size_t n = 4099;
  const Values start = Random(n, 51);
  float* params = Upload(start);
  uint16_t* working = Poisoned<uint16_t>(n);
  ASSERT_OK(cuda::Convert(params, DType::kF32, working, DType::kBF16, int64_t(n), s()));
  float* flag = Poisoned<float>(1);
  auto adamw = cuda::AdamW::Create(int64_t(n), {}, s());
  ASSERT_TRUE(adamw.ok()) << adamw.status().ToString();
  LossScaler scaler;

  auto step = [&](Values grads) -> bool {
    for (float& g : grads) g *= scaler.scale();
    float* d = Upload(grads);
    EXPECT_TRUE(cuda::UnscaleAndCheckFinite(d, int64_t(n), scaler.inv_scale(), flag, s()).ok());
    auto found = cuda::ReadFoundInf(flag, s());
    EXPECT_TRUE(found.ok()) << found.status().ToString();
    if (!found.ok()) return false;
    if (!*found) {
      EXPECT_TRUE(adamw->Step(params, d, s(), {working, DType::kBF16}).ok());
    }
    scaler.Update(*found);
    return !*found;
  };
  ASSERT_TRUE(step(Random(n, 52)));
  const Values p1 = Download(params, n), m1 = Download(adamw->first_moment(), n);
  const auto w1 = Download<uint16_t>(working, n);
  Values bad = Random(n, 53);
  bad[1234] = INFINITY;
  EXPECT_FALSE(step(bad));
  EXPECT_EQ(scaler.scale(), 32768.0f);
  EXPECT_EQ(adamw->step_count(), 1);
  const Values p2 = Download(params, n), m2 = Download(adamw->first_moment(), n);
  const auto w2 = Download<uint16_t>(working, n);
  EXPECT_EQ(std::memcmp(p1.data(), p2.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(m1.data(), m2.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(w1.data(), w2.data(), n * sizeof(uint16_t)), 0);
  EXPECT_NE(std::memcmp(p1.data(), start.data(), n * sizeof(float)), 0);  // the clean step did move them
}

// ---- Optimizers ------------------------------------------------------------------

// Three steps of the fused kernel against models::AdamW, optionally writing a
// working copy, on aligned and misaligned (scalar path) buffers.
TEST_F(CudaOps, AdamWMatchesCpuAdamW) {
  const AdamWOptions options{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.05f};
  for (size_t offset : {0, 1}) {
    for (DType working_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {  // kF32 here: no working copy
      const size_t n = 100003;
      Values cpu = Random(n, 61);
      AdamW reference(options);
      Values host = cpu;
      host.insert(host.begin(), offset, 0.0f);
      float* params = Upload(host) + offset;
      const bool with_copy = working_dtype != DType::kF32;
      uint16_t* working = with_copy ? Poisoned<uint16_t>(n + offset) + offset : nullptr;
      auto adamw = cuda::AdamW::Create(int64_t(n), options, s());
      ASSERT_TRUE(adamw.ok());
      for (int t = 0; t < 3; ++t) {
        Values g = Random(n + offset, 62 + t);
        reference.Step(cpu, std::span<const float>(g).subspan(offset));
        ASSERT_OK(adamw->Step(params, Upload(g) + offset, s(), {working, working_dtype}));
      }
      EXPECT_EQ(adamw->step_count(), 3);
      const Values p = Download(params, n);
      EXPECT_LE(RelativeError(p, cpu), kF32Tolerance) << offset;
      EXPECT_LE(RelativeError(Download(adamw->first_moment(), n), Values(reference.first_moment().begin(),
                                                                          reference.first_moment().end())),
                kF32Tolerance);
      EXPECT_LE(RelativeError(Download(adamw->second_moment(), n), Values(reference.second_moment().begin(),
                                                                           reference.second_moment().end())),
                kF32Tolerance);
      if (with_copy) {
        // The working copy is the kernel's own new fp32 value, rounded once.
        const auto bits = Download<uint16_t>(working, n);
        Values low(n);
        working_dtype == DType::kBF16 ? Bf16ToFloat(bits, low) : F16ToFloat(bits, low);
        for (size_t i = 0; i < n; ++i) {
          const uint16_t want = working_dtype == DType::kBF16 ? FloatToBf16(p[i]) : FloatToF16(p[i]);
          ASSERT_EQ(bits[i], want) << i;
        }
        EXPECT_LE(RelativeError(low, cpu), kLowPrecisionTolerance);
      }
    }
  }
}

TEST_F(CudaOps, SgdMatchesCpuSgdWithAndWithoutMomentum) {
  for (float momentum : {0.0f, 0.9f}) {
    const size_t n = 50001;
    Values cpu = Random(n, 71);
    Sgd reference(0.05f, momentum, 1e-3f);
    float* params = Upload(cpu);
    uint16_t* working = Poisoned<uint16_t>(n);
    auto sgd = cuda::Sgd::Create(int64_t(n), 0.05f, momentum, 1e-3f);
    ASSERT_TRUE(sgd.ok());
    for (int t = 0; t < 3; ++t) {
      const Values g = Random(n, 72 + t);
      reference.Step(cpu, g);
      ASSERT_OK(sgd->Step(params, Upload(g), s(), {working, DType::kF16}));
    }
    EXPECT_LE(RelativeError(Download(params, n), cpu), kF32Tolerance) << momentum;
    const auto bits = Download<uint16_t>(working, n);
    Values low(n);
    F16ToFloat(bits, low);
    EXPECT_LE(RelativeError(low, cpu), kLowPrecisionTolerance);
    // Reset: the next step re-initialises the momentum, on both sides.
    reference.Reset();
    sgd->Reset();
    const Values g = Random(n, 80);
    reference.Step(cpu, g);
    ASSERT_OK(sgd->Step(params, Upload(g), s()));
    EXPECT_LE(RelativeError(Download(params, n), cpu), kF32Tolerance) << momentum;
  }
}

// A ZeRO-1 rank's pieces: three slices lying apart in one device buffer, at
// offsets that defeat the vector path for some, stepped as one parameter set
// against the CPU optimizers over the same slices (which the torch oracle
// checks); the values between the slices stay as they were.
TEST_F(CudaOps, OptimizersStepSlicesLyingApartAsTheCpuOnesDo) {
  const size_t sizes[3] = {4099, 1, 30000}, gap = 3;
  const size_t total = sizes[0] + sizes[1] + sizes[2], span = total + 3 * gap;
  for (bool use_adamw : {true, false}) {
    SCOPED_TRACE(use_adamw ? "adamw" : "sgd");
    Values cpu_params = Random(span, 91);
    float* params = Upload(cpu_params);
    float* grads = Poisoned<float>(span);
    std::vector<ParameterSlice> cpu_slices, device_slices;
    Values cpu_grads(span);
    for (size_t i = 0, at = gap; i < 3; at += sizes[i] + gap, ++i) {
      cpu_slices.push_back({&cpu_params[at], &cpu_grads[at], sizes[i]});
      device_slices.push_back({params + at, grads + at, sizes[i]});
    }
    const Values before = cpu_params;
    AdamW cpu_adamw({.lr = 1e-2f, .weight_decay = 0.05f});
    Sgd cpu_sgd(0.05f, 0.9f, 1e-3f);
    auto adamw = cuda::AdamW::Create(int64_t(total), {.lr = 1e-2f, .weight_decay = 0.05f}, s());
    auto sgd = cuda::Sgd::Create(int64_t(total), 0.05f, 0.9f, 1e-3f);
    ASSERT_TRUE(adamw.ok() && sgd.ok());
    for (int t = 0; t < 3; ++t) {
      const Values g = Random(span, 92 + t);
      std::copy(g.begin(), g.end(), cpu_grads.begin());  // the slices point into cpu_grads
      ASSERT_OK(cuda::CopyToDevice(grads, cpu_grads.data(), span * sizeof(float), s()));
      if (use_adamw) {
        cpu_adamw.Step(cpu_slices);
        ASSERT_OK(adamw->Step(device_slices, s()));
      } else {
        cpu_sgd.Step(cpu_slices);
        ASSERT_OK(sgd->Step(device_slices, s()));
      }
    }
    const Values got = Download(params, span);
    EXPECT_LE(RelativeError(got, cpu_params), kF32Tolerance);
    for (size_t i = 0, at = gap, from = 0; i < 3; from = at + sizes[i], at += sizes[i] + gap, ++i) {
      for (size_t k = from; k < at; ++k) ASSERT_EQ(got[k], before[k]) << "the gap before slice " << i << " moved";
    }
    if (use_adamw) {
      EXPECT_EQ(adamw->step_count(), 3);
    }
  }
  // Slices that do not hold the optimizer's count are refused, naming both.
  auto adamw = cuda::AdamW::Create(10, {}, s());
  ASSERT_TRUE(adamw.ok());
  const ParameterSlice short_slice{Poisoned<float>(9), Poisoned<float>(9), 9};
  const Status refused = adamw->Step(std::span<const ParameterSlice>(&short_slice, 1), s());
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("slices of 9 elements, the optimizer holds state for 10"), std::string::npos)
      << refused.message();
}

TEST_F(CudaOps, ClipGradNormMatchesCpu) {
  for (double max_norm : {1.0, 1e6}) {  // clipping, and a coefficient clamped to 1
    const size_t n = 262147;
    Values cpu = Random(n, 91);
    float* g = Upload(cpu);
    double* norm = static_cast<double*>(Poisoned(sizeof(double)));
    const double want_norm = ClipGradNorm(cpu, max_norm);
    arena_.Reset();
    ASSERT_OK(cuda::ClipGradNorm(g, int64_t(n), max_norm, norm, arena_, s()));
    const double got_norm = Download<double>(norm, 1)[0];
    EXPECT_LE(std::abs(got_norm - want_norm) / want_norm, kF32Tolerance) << got_norm << " vs " << want_norm;
    EXPECT_LE(RelativeError(Download(g, n), cpu), kF32Tolerance) << max_norm;
  }
}

// ---- Layers -----------------------------------------------------------------------

TEST_F(CudaOps, ReluForwardAndBackwardMatchCpu) {
  for (size_t offset : {0, 3}) {
    const size_t n = 30011;
    Values x = Random(n + offset, 101), dy = Random(n + offset, 102);
    float *gx = Upload(x) + offset, *gdy = Upload(dy) + offset;
    Values y(x.begin() + offset, x.end()), g(dy.begin() + offset, dy.end());
    ReluForward(y.data(), int64_t(n));
    ReluBackward(y.data(), g.data(), int64_t(n));
    ASSERT_OK(cuda::ReluForward(gx, int64_t(n), s()));
    ASSERT_OK(cuda::ReluBackward(gx, gdy, int64_t(n), s()));
    EXPECT_EQ(Download(gx, n), y);
    EXPECT_EQ(Download(gdy, n), g);
  }
}

// A Linear layer from the pieces: BroadcastBias + Gemm forward, Gemm +
// BiasGradient backward, against models::Linear.
TEST_F(CudaOps, LinearFromBiasAndGemmMatchesCpuLinear) {
  const int n = 19, in = 77, out = 33;
  Values x = Random(size_t(n) * in, 111), w = Random(size_t(out) * in, 112), b = Random(out, 113),
         dy = Random(size_t(n) * out, 114);
  Values y(size_t(n) * out), dx(size_t(n) * in), dw(w.size()), db(b.size());
  Linear cpu{in, out, w.data(), b.data(), dw.data(), db.data()};
  cpu.Forward(x.data(), n, y.data());
  cpu.Backward(x.data(), dy.data(), n, dx.data());

  float *gx = Upload(x), *gw = Upload(w), *gb = Upload(b), *gdy = Upload(dy);
  float *gy = Poisoned<float>(y.size()), *gdx = Poisoned<float>(dx.size()), *gdw = Poisoned<float>(dw.size()),
        *gdb = Poisoned<float>(db.size());
  ASSERT_OK(cuda::BroadcastBias(gb, n, out, 1, gy, s()));
  ASSERT_OK(cuda::Gemm(blas_, false, true, n, out, in, 1.0f, gx, in, gw, in, 1.0f, gy, out));
  ASSERT_OK(cuda::Gemm(blas_, true, false, out, in, n, 1.0f, gdy, out, gx, in, 0.0f, gdw, in));
  ASSERT_OK(cuda::BiasGradient(gdy, n, out, 1, gdb, s()));
  ASSERT_OK(cuda::Gemm(blas_, false, false, n, in, out, 1.0f, gdy, out, gw, in, 0.0f, gdx, in));
  EXPECT_LE(RelativeError(Download(gy, y.size()), y), kF32Tolerance);
  EXPECT_LE(RelativeError(Download(gdw, dw.size()), dw), kF32Tolerance);
  EXPECT_LE(RelativeError(Download(gdb, db.size()), db), kF32Tolerance);
  EXPECT_LE(RelativeError(Download(gdx, dx.size()), dx), kF32Tolerance);
}

// A Conv2d from the pieces, per image as the CPU layer: Im2Col (compared with
// the CPU's cols), Gemm + bias forward; Gemm + Col2Im and BiasGradient backward.
TEST_F(CudaOps, ConvFromIm2ColGemmCol2ImMatchesCpuConv2d) {
  for (auto [k, pad] : {std::pair{5, 2}, std::pair{3, 0}}) {
    const int n = 3, c = 4, h = 10, wd = 9, oc = 6;
    Conv2d cpu{c, oc, k, pad, h, wd};
    const int hw = h * wd, kdim = c * k * k;
    Values x = Random(size_t(n) * c * hw, 121), w = Random(size_t(oc) * kdim, 122), b = Random(oc, 123),
           dy = Random(size_t(n) * oc * hw, 124);
    Values dw(w.size()), db(b.size());
    cpu.w = w.data(), cpu.b = b.data(), cpu.dw = dw.data(), cpu.db = db.data();
    Values cols(size_t(n) * cpu.col_size()), y(size_t(n) * oc * hw), dcol(cpu.col_size()), dx(x.size());
    // The CPU layer keeps outputs at h x w for any pad below k (a plain same-size
    // conv at pad = (k-1)/2); the GPU pieces must agree either way.
    cpu.Forward(x.data(), n, cols.data(), y.data());
    cpu.Backward(cols.data(), dy.data(), n, dcol.data(), dx.data());

    const cuda::ConvShape shape{n, c, h, wd, k, pad};
    float *gx = Upload(x), *gw = Upload(w), *gb = Upload(b), *gdy = Upload(dy);
    float* gcols = Poisoned<float>(cols.size());
    ASSERT_OK(cuda::Im2Col(gx, shape, gcols, s()));
    EXPECT_EQ(Download(gcols, cols.size()), cols) << "k=" << k << " pad=" << pad;

    float *gy = Poisoned<float>(y.size()), *gdw = Poisoned<float>(dw.size()), *gdb = Poisoned<float>(db.size()),
          *gdcols = Poisoned<float>(cols.size()), *gdx = Poisoned<float>(dx.size());
    ASSERT_OK(cuda::BroadcastBias(gb, n, oc, hw, gy, s()));
    for (int i = 0; i < n; ++i) {
      const float* col = gcols + size_t(i) * cpu.col_size();
      const float* g = gdy + size_t(i) * oc * hw;
      ASSERT_OK(cuda::Gemm(blas_, false, false, oc, hw, kdim, 1.0f, gw, kdim, col, hw, 1.0f, gy + size_t(i) * oc * hw,
                           hw));
      ASSERT_OK(cuda::Gemm(blas_, false, true, oc, kdim, hw, 1.0f, g, hw, col, hw, i == 0 ? 0.0f : 1.0f, gdw, kdim));
      ASSERT_OK(cuda::Gemm(blas_, true, false, kdim, hw, oc, 1.0f, gw, kdim, g, hw, 0.0f,
                           gdcols + size_t(i) * cpu.col_size(), hw));
    }
    ASSERT_OK(cuda::Col2Im(gdcols, shape, gdx, s()));
    ASSERT_OK(cuda::BiasGradient(gdy, n, oc, hw, gdb, s()));
    EXPECT_LE(RelativeError(Download(gy, y.size()), y), kF32Tolerance);
    EXPECT_LE(RelativeError(Download(gdw, dw.size()), dw), kF32Tolerance);
    EXPECT_LE(RelativeError(Download(gdb, db.size()), db), kF32Tolerance);
    EXPECT_LE(RelativeError(Download(gdx, dx.size()), dx), kF32Tolerance);
  }
}

TEST_F(CudaOps, MaxPoolForwardAndBackwardMatchCpuIncludingTies) {
  const int n = 3, c = 5, h = 12, w = 14;
  Values x = Random(size_t(n) * c * h * w, 131);
  for (size_t i = 0; i < x.size(); i += 3) x[i] = std::round(x[i] * 2.0f) / 2.0f;  // plenty of ties
  const size_t outputs = size_t(n) * c * (h / 2) * (w / 2);
  Values dy = Random(outputs, 132), y(outputs), dx(x.size());
  std::vector<int32_t> argmax(outputs);
  MaxPool2 cpu{c, h, w};
  cpu.Forward(x.data(), n, y.data(), argmax.data());
  cpu.Backward(dy.data(), argmax.data(), n, dx.data());

  float *gx = Upload(x), *gdy = Upload(dy), *gy = Poisoned<float>(outputs), *gdx = Poisoned<float>(x.size());
  int32_t* garg = Poisoned<int32_t>(outputs);
  ASSERT_OK(cuda::MaxPool2Forward(gx, n, c, h, w, gy, garg, s()));
  ASSERT_OK(cuda::MaxPool2Backward(gdy, garg, n, c, h, w, gdx, s()));
  EXPECT_EQ(Download(gy, outputs), y);
  EXPECT_EQ(Download<int32_t>(garg, outputs), argmax);
  EXPECT_EQ(Download(gdx, x.size()), dx);
  EXPECT_EQ(cuda::MaxPool2Forward(gx, n, c, 7, w, gy, garg, s()).code(), Code::kInvalidArgument);
}

TEST_F(CudaOps, SoftmaxCrossEntropyMatchesCpu) {
  for (int classes : {10, 1000}) {
    const int n = 37;
    Values z = Random(size_t(n) * classes, 141, 3.0f);
    std::vector<int32_t> labels(n);
    std::mt19937 rng(142);
    for (int32_t& l : labels) l = int32_t(rng() % classes);
    // Make some rows right and a tie in one, so the count and the tie rule are exercised.
    for (int i = 0; i < n; i += 4) z[size_t(i) * classes + labels[i]] = 10.0f;
    z[1] = z[0] = 12.0f;  // row 0: classes 0 and 1 tie; the first wins
    Values dz(z.size());
    int64_t correct = 0;
    const float loss = SoftmaxCrossEntropy(z.data(), labels.data(), n, classes, dz.data(), &correct);

    arena_.Reset();
    float *gz = Upload(z), *gdz = Poisoned<float>(z.size()), *gloss = Poisoned<float>(1);
    int32_t* glabels = Upload(labels);
    int64_t* gcorrect = Upload(std::vector<int64_t>{5});
    ASSERT_OK(cuda::SoftmaxCrossEntropy(gz, glabels, n, classes, gdz, gloss, gcorrect, arena_, s()));
    const float got = Download(gloss, 1)[0];
    EXPECT_LE(std::abs(got - loss) / std::abs(loss), kF32Tolerance) << got << " vs " << loss;
    EXPECT_LE(RelativeError(Download(gdz, z.size()), dz), kF32Tolerance);
    EXPECT_EQ(Download<int64_t>(gcorrect, 1)[0], 5 + correct);
    EXPECT_GT(correct, 0);

    // A label out of range poisons the loss instead of reading past the row.
    labels[3] = classes;
    int32_t* bad_labels = Upload(labels);
    ASSERT_OK(cuda::SoftmaxCrossEntropy(gz, bad_labels, n, classes, nullptr, gloss, nullptr, arena_, s()));
    EXPECT_TRUE(std::isnan(Download(gloss, 1)[0]));
  }
}

}  // namespace
}  // namespace estuary::models
