// The decoder's CUDA ops (models/cuda/transformer.h) against the CPU ops of
// models/transformer_ops.h, forward and backward, on seeded random non-zero
// inputs, with every device output poisoned (NaN bytes) first, so an element
// a kernel forgets cannot pass. Accumulating outputs start from random values,
// not zeros, so a kernel that overwrites instead of adding fails.
//
// Metric: max|gpu - cpu| / max|cpu|. fp32 within 1e-5. bf16/fp16: the CPU op
// runs on the same inputs rounded to bf16/fp16, and the GPU output must be
// within 1e-2. Tests skip, naming the reason, without a usable device; the
// argument checks need none and always run.
#include <cblas.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "models/cuda/blas.h"
#include "models/cuda/device.h"
#include "models/cuda/flash_attention.h"
#include "models/cuda/transformer.h"
#include "models/precision.h"
#include "models/transformer_ops.h"

namespace estuary::models {
namespace {

using Values = std::vector<float>;
using Bits = std::vector<uint16_t>;

constexpr double kF32Tolerance = 1e-5;
constexpr double kLowTolerance = 1e-2;

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

Values Random(size_t n, uint32_t seed, float magnitude = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.1f, 1.0f);
  Values v(n);
  for (float& x : v) x = (rng() & 1 ? 1.0f : -1.0f) * u(rng) * magnitude;
  return v;
}

std::vector<int32_t> RandomIds(size_t n, int32_t limit, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(n);
  for (int32_t& id : ids) id = int32_t(rng() % uint32_t(limit));
  return ids;
}

// Values rounded to a 16-bit dtype (and their bits), and back.
Bits ToBits(const Values& v, DType dtype) {
  Bits bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) bits[i] = dtype == DType::kBF16 ? FloatToBf16(v[i]) : FloatToF16(v[i]);
  return bits;
}
Values FromBits(const Bits& bits, DType dtype) {
  Values v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) v[i] = dtype == DType::kBF16 ? Bf16ToFloat(bits[i]) : F16ToFloat(bits[i]);
  return v;
}
Values Rounded(const Values& v, DType dtype) { return dtype == DType::kF32 ? v : FromBits(ToBits(v, dtype), dtype); }

#define ASSERT_OK(expr)                              \
  do {                                               \
    const ::estuary::Status status_ = (expr);        \
    ASSERT_TRUE(status_.ok()) << status_.ToString(); \
  } while (0)

class CudaTransformer : public ::testing::Test {
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

  void* Poisoned(size_t bytes) {
    auto buffer = cuda::DeviceBuffer::Allocate(std::max<size_t>(bytes, 1));
    EXPECT_TRUE(buffer.ok()) << buffer.status().ToString();
    if (!buffer.ok()) return nullptr;
    EXPECT_TRUE(cuda::FillBytes(buffer->data(), 0xff, buffer->size(), s()).ok());
    buffers_.push_back(std::move(*buffer));
    return buffers_.back().data();
  }
  template <typename T>
  T* Upload(const std::vector<T>& host) {
    T* p = static_cast<T*>(Poisoned(host.size() * sizeof(T)));
    EXPECT_TRUE(p && cuda::CopyToDevice(p, host.data(), host.size() * sizeof(T), s()).ok());
    return p;
  }
  // Uploads values as `dtype` (f32 as is, else rounded to 16 bits).
  void* UploadAs(const Values& v, DType dtype) {
    if (dtype == DType::kF32) return Upload(v);
    return Upload(ToBits(v, dtype));
  }
  // count elements of `dtype` back as floats.
  Values DownloadAs(const void* device, size_t count, DType dtype) {
    if (dtype == DType::kF32) {
      Values host(count);
      EXPECT_TRUE(cuda::CopyToHost(host.data(), device, count * sizeof(float), s()).ok());
      return host;
    }
    Bits bits(count);
    EXPECT_TRUE(cuda::CopyToHost(bits.data(), device, count * sizeof(uint16_t), s()).ok());
    return FromBits(bits, dtype);
  }
  Values Download(const float* device, size_t count) { return DownloadAs(device, count, DType::kF32); }

  cuda::Stream stream_;
  cuda::Blas blas_;
  cuda::Arena arena_;
  std::vector<cuda::DeviceBuffer> buffers_;
};

double Tolerance(DType dtype) { return dtype == DType::kF32 ? kF32Tolerance : kLowTolerance; }

TEST(CudaTransformerArgs, BadShapesAreRejectedBeforeTouchingTheDevice) {
  cuda::Blas empty;
  float dummy = 0;
  Status s = cuda::AttentionForward(empty, DType::kF32, &dummy, 2, 8, 6, 4, 16, &dummy, &dummy, &dummy);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("heads=6 kv_heads=4"), std::string::npos) << s.message();
  s = cuda::RopeForward(&dummy, DType::kF32, 1, 4, 2, 7, 14, &dummy, &dummy, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("head_dim=7"), std::string::npos) << s.message();
  s = cuda::RopeForward(&dummy, DType::kF32, 1, 4, 2, 8, 15, &dummy, &dummy, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("row_stride 15"), std::string::npos) << s.message();
  s = cuda::SwiGluForward(&dummy, 4, 0, &dummy, DType::kF32, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("dim=0"), std::string::npos) << s.message();
  cuda::Arena arena;
  s = cuda::CrossEntropyForwardBackward(&dummy, nullptr, 3, 10, &dummy, DType::kBF16, 1.0f, &dummy, arena, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("null buffer"), std::string::npos) << s.message();
  int32_t id = 0;
  s = cuda::CrossEntropyForwardBackward(&dummy, &id, 1, 1, &dummy, DType::kBF16, 1.0f, &dummy, arena, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("bf16 dlogits cannot overwrite"), std::string::npos) << s.message();
  s = cuda::GemmStridedBatched(empty, false, false, 4, 4, 4, 1.0f, &dummy, 4, 16, &dummy, 4, 16, 0.0f, &dummy, 4, 8,
                               2);
  ASSERT_FALSE(s.ok());  // an empty handle is reported first
  EXPECT_NE(s.message().find("Blas handle is empty"), std::string::npos) << s.message();
}

// ---- batched GEMM ------------------------------------------------------------

TEST_F(CudaTransformer, StridedBatchedGemmMatchesOneCblasCallPerMatrix) {
  for (const bool ta : {false, true}) {
    for (const bool tb : {false, true}) {
      const int m = 19, n = 23, k = 31, batch = 3, pad = 5;
      const int lda = (ta ? m : k) + pad, ldb = (tb ? k : n) + pad, ldc = n + pad;
      const int64_t sa = int64_t(ta ? k : m) * lda + 7, sb = int64_t(tb ? n : k) * ldb + 3, sc = int64_t(m) * ldc + 11;
      Values a = Random(sa * batch, 1), b = Random(sb * batch, 2), c = Random(sc * batch, 3);
      Values want = c;
      for (int i = 0; i < batch; ++i) {
        cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, 0.5f,
                    a.data() + i * sa, lda, b.data() + i * sb, ldb, -1.5f, want.data() + i * sc, ldc);
      }
      float *da = Upload(a), *db = Upload(b), *dc = Upload(c);
      ASSERT_OK(cuda::GemmStridedBatched(blas_, ta, tb, m, n, k, 0.5f, da, lda, sa, db, ldb, sb, -1.5f, dc, ldc, sc,
                                         batch));
      EXPECT_LE(RelativeError(Download(dc, c.size()), want), kF32Tolerance) << ta << tb;
    }
  }
  // Overlapping outputs are refused.
  float* p = Upload(Random(64, 4));
  const Status s = cuda::GemmStridedBatched(blas_, false, false, 4, 4, 4, 1.0f, p, 4, 16, p, 4, 16, 0.0f, p, 4, 8, 2);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("overlap"), std::string::npos) << s.message();
}

// ---- embedding -------------------------------------------------------------

TEST_F(CudaTransformer, EmbeddingForwardAndBackwardMatchTheCpu) {
  for (const int dim : {32, 13}) {  // vectorised and scalar paths
    const int vocab = 37, n = 300;
    // Many repeats: every token occurs about eight times.
    const std::vector<int32_t> tokens = RandomIds(n, vocab, 5);
    const Values table = Random(size_t(vocab) * dim, 6), dout = Random(size_t(n) * dim, 7);
    Values out(size_t(n) * dim), dtable = Random(size_t(vocab) * dim, 8);
    const Values dtable_before = dtable;
    EmbeddingForward(tokens.data(), n, table.data(), dim, out.data());
    EmbeddingBackward(tokens.data(), n, dout.data(), dim, dtable.data());

    int32_t* d_tokens = Upload(tokens);
    float* d_out = static_cast<float*>(Poisoned(out.size() * sizeof(float)));
    ASSERT_OK(cuda::EmbeddingForward(d_tokens, n, Upload(table), vocab, dim, d_out, s()));
    EXPECT_EQ(Download(d_out, out.size()), out) << dim;  // a copy: exact
    float* d_dtable = Upload(dtable_before);
    arena_.Reset();
    ASSERT_OK(cuda::EmbeddingBackward(d_tokens, n, Upload(dout), vocab, dim, d_dtable, arena_, s()));
    // The same additions in the same order: exact.
    EXPECT_EQ(Download(d_dtable, dtable.size()), dtable) << dim;
  }
}

// ---- RMSNorm ---------------------------------------------------------------

TEST_F(CudaTransformer, RmsNormForwardAndBackwardMatchTheCpu) {
  const int n = 300, dim = 96;  // 300 rows: three chunks of the weight-gradient partials
  const float eps = 1e-5f;
  const Values x = Random(size_t(n) * dim, 10, 3.0f), weight = Random(dim, 11), dy = Random(size_t(n) * dim, 12);
  Values y(x.size()), rstd(n), dx = Random(x.size(), 13), dweight(dim);
  const Values dx_before = dx;
  RmsNormForward(x.data(), weight.data(), n, dim, eps, y.data(), rstd.data());
  RmsNormBackward(x.data(), weight.data(), rstd.data(), dy.data(), n, dim, dx.data(), dweight.data());

  float *d_x = Upload(x), *d_w = Upload(weight), *d_dy = Upload(dy);
  for (const DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    void* d_y = Poisoned(x.size() * DTypeSize(dtype));
    float* d_rstd = static_cast<float*>(Poisoned(n * sizeof(float)));
    ASSERT_OK(cuda::RmsNormForward(d_x, d_w, n, dim, eps, d_y, dtype, d_rstd, s()));
    EXPECT_LE(RelativeError(DownloadAs(d_y, y.size(), dtype), y), Tolerance(dtype)) << DTypeName(dtype);
    EXPECT_LE(RelativeError(Download(d_rstd, n), rstd), kF32Tolerance);
  }
  float* d_rstd = Upload(rstd);
  for (const DType copy : {DType::kF32, DType::kBF16}) {  // without and with the low-precision copy of dx
    float* d_dx = Upload(dx_before);
    float* d_dweight = static_cast<float*>(Poisoned(dim * sizeof(float)));
    void* d_copy = copy == DType::kF32 ? nullptr : Poisoned(dx.size() * 2);
    arena_.Reset();
    ASSERT_OK(cuda::RmsNormBackward(d_x, d_w, d_rstd, d_dy, n, dim, d_dx, d_dweight, arena_, s(), d_copy, copy));
    EXPECT_LE(RelativeError(Download(d_dx, dx.size()), dx), kF32Tolerance);
    EXPECT_LE(RelativeError(Download(d_dweight, dim), dweight), kF32Tolerance);
    if (d_copy) {
      EXPECT_LE(RelativeError(DownloadAs(d_copy, dx.size(), copy), dx), kLowTolerance);
    }
  }
}

// ---- RoPE ------------------------------------------------------------------

TEST_F(CudaTransformer, RopeTablesForwardAndBackwardMatchTheCpu) {
  const int max_seq = 40, head_dim = 16, half = head_dim / 2;
  const double theta = 10000.0;
  Values cos(size_t(max_seq) * half), sin(cos.size());
  RopeTables(max_seq, head_dim, theta, cos.data(), sin.data());
  float* d_cos = static_cast<float*>(Poisoned(cos.size() * sizeof(float)));
  float* d_sin = static_cast<float*>(Poisoned(sin.size() * sizeof(float)));
  ASSERT_OK(cuda::RopeTables(max_seq, head_dim, theta, d_cos, d_sin, s()));
  EXPECT_LE(RelativeError(Download(d_cos, cos.size()), cos), 1e-6);
  EXPECT_LE(RelativeError(Download(d_sin, sin.size()), sin), 1e-6);

  // Three heads rotated inside rows of 5 heads plus 3 extra columns.
  const int batch = 2, seq = 33, heads = 3;
  const int64_t stride = 5 * head_dim + 3;
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    const Values x = Rounded(Random(size_t(batch) * seq * stride, 20), dtype);
    Values fwd = x, bwd = x;
    RopeForward(fwd.data(), batch, seq, heads, head_dim, stride, cos.data(), sin.data());
    RopeBackward(bwd.data(), batch, seq, heads, head_dim, stride, cos.data(), sin.data());
    void* d_fwd = UploadAs(x, dtype);
    void* d_bwd = UploadAs(x, dtype);
    ASSERT_OK(cuda::RopeForward(d_fwd, dtype, batch, seq, heads, head_dim, stride, d_cos, d_sin, s()));
    ASSERT_OK(cuda::RopeBackward(d_bwd, dtype, batch, seq, heads, head_dim, stride, d_cos, d_sin, s()));
    const Values got_fwd = DownloadAs(d_fwd, x.size(), dtype), got_bwd = DownloadAs(d_bwd, x.size(), dtype);
    EXPECT_LE(RelativeError(got_fwd, fwd), Tolerance(dtype)) << DTypeName(dtype);
    EXPECT_LE(RelativeError(got_bwd, bwd), Tolerance(dtype)) << DTypeName(dtype);
    // Columns outside the rotated heads are untouched, bit for bit.
    for (int64_t r = 0; r < int64_t(batch) * seq; ++r) {
      for (int64_t c = int64_t(heads) * head_dim; c < stride; ++c) ASSERT_EQ(got_fwd[r * stride + c], x[r * stride + c]);
    }
  }
}

// ---- SwiGLU ----------------------------------------------------------------

TEST_F(CudaTransformer, SwiGluForwardAndBackwardMatchTheCpu) {
  for (const int hidden : {64, 13}) {
    for (const DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      const int n = 77;
      const Values gate_up = Rounded(Random(size_t(n) * 2 * hidden, 30, 4.0f), dtype);
      const Values dout = Rounded(Random(size_t(n) * hidden, 31), dtype);
      Values out(size_t(n) * hidden), dgate_up(gate_up.size());
      SwiGluForward(gate_up.data(), n, hidden, out.data());
      SwiGluBackward(gate_up.data(), dout.data(), n, hidden, dgate_up.data());
      const void* d_gu = UploadAs(gate_up, dtype);
      void* d_out = Poisoned(out.size() * DTypeSize(dtype));
      void* d_dgu = Poisoned(dgate_up.size() * DTypeSize(dtype));
      ASSERT_OK(cuda::SwiGluForward(d_gu, n, hidden, d_out, dtype, s()));
      ASSERT_OK(cuda::SwiGluBackward(d_gu, UploadAs(dout, dtype), n, hidden, d_dgu, dtype, s()));
      EXPECT_LE(RelativeError(DownloadAs(d_out, out.size(), dtype), out), Tolerance(dtype))
          << hidden << " " << DTypeName(dtype);
      EXPECT_LE(RelativeError(DownloadAs(d_dgu, dgate_up.size(), dtype), dgate_up), Tolerance(dtype))
          << hidden << " " << DTypeName(dtype);
    }
  }
}

TEST_F(CudaTransformer, ResidualAddMatchesTheCpu) {
  for (const int64_t count : {int64_t(4096), int64_t(1001)}) {  // whole quads, and a tail
    const Values x = Random(count, 40);
    Values y = Random(count, 41);
    float* d_y = Upload(y);
    ResidualAdd(x.data(), count, y.data());
    ASSERT_OK(cuda::ResidualAdd(Upload(x), count, d_y, s()));
    EXPECT_EQ(Download(d_y, count), y) << count;
  }
}

// ---- attention -------------------------------------------------------------

struct AttentionCase {
  int batch, seq, heads, kv_heads, head_dim;
};

TEST_F(CudaTransformer, CausalGqaAttentionForwardAndBackwardMatchTheCpu) {
  for (const AttentionCase& c : {AttentionCase{2, 37, 4, 2, 16}, AttentionCase{3, 20, 3, 3, 8},
                                 AttentionCase{1, 64, 8, 1, 32}}) {
    for (const DType dtype : {DType::kF32, DType::kBF16}) {
      const int64_t width = int64_t(c.heads + 2 * c.kv_heads) * c.head_dim, n = int64_t(c.batch) * c.seq;
      const int64_t out_width = int64_t(c.heads) * c.head_dim;
      const int64_t square = int64_t(c.batch) * c.heads * c.seq * c.seq;
      const Values qkv = Rounded(Random(n * width, 50, 2.0f), dtype);
      const Values dout = Rounded(Random(n * out_width, 51), dtype);
      Values probs(square), out(n * out_width), dscores(int64_t(c.seq) * c.seq), dqkv(qkv.size());
      AttentionForward(qkv.data(), c.batch, c.seq, c.heads, c.kv_heads, c.head_dim, probs.data(), out.data());
      AttentionBackward(qkv.data(), probs.data(), dout.data(), c.batch, c.seq, c.heads, c.kv_heads, c.head_dim,
                        dscores.data(), dqkv.data());

      const void* d_qkv = UploadAs(qkv, dtype);
      void* d_probs = Poisoned(square * DTypeSize(dtype));
      void* d_out = Poisoned(out.size() * DTypeSize(dtype));
      float* scores = dtype == DType::kF32 ? static_cast<float*>(d_probs)
                                           : static_cast<float*>(Poisoned(square * sizeof(float)));
      ASSERT_OK(cuda::AttentionForward(blas_, dtype, d_qkv, c.batch, c.seq, c.heads, c.kv_heads, c.head_dim, scores,
                                       d_probs, d_out));
      const std::string what = std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " " +
                               std::string(DTypeName(dtype));
      EXPECT_LE(RelativeError(DownloadAs(d_probs, probs.size(), dtype), probs), Tolerance(dtype)) << what;
      EXPECT_LE(RelativeError(DownloadAs(d_out, out.size(), dtype), out), Tolerance(dtype)) << what;

      // Backward from the CPU's probabilities (rounded like the GPU's own), so
      // that it is checked on its own.
      const void* d_p = UploadAs(probs, dtype);
      float* dprobs = static_cast<float*>(Poisoned(square * sizeof(float)));
      void* ds = dtype == DType::kF32 ? static_cast<void*>(dprobs) : Poisoned(square * DTypeSize(dtype));
      void* d_dqkv = Poisoned(qkv.size() * DTypeSize(dtype));
      ASSERT_OK(cuda::AttentionBackward(blas_, dtype, d_qkv, d_p, UploadAs(dout, dtype), c.batch, c.seq, c.heads,
                                        c.kv_heads, c.head_dim, dprobs, ds, d_dqkv));
      if (dtype == DType::kBF16) {
        // Reference on the rounded probabilities the GPU read.
        const Values p16 = Rounded(probs, dtype);
        AttentionBackward(qkv.data(), p16.data(), dout.data(), c.batch, c.seq, c.heads, c.kv_heads, c.head_dim,
                          dscores.data(), dqkv.data());
      }
      EXPECT_LE(RelativeError(DownloadAs(d_dqkv, dqkv.size(), dtype), dqkv), Tolerance(dtype)) << what;
    }
  }
}

// The fused kernels (flash_attention.h) against the CPU's attention in fp32
// on the same rounded inputs: out, every element of dqkv, and each row's
// log-sum-exp; sequences shorter than a 64-row tile, ending mid-tile and
// filling whole tiles, batch > 1, MHA, GQA and MQA (a kv head's gradient then
// sums 8 query heads), a one-token sequence. Their products round the
// probabilities to bf16/fp16, which the 1e-2 bound covers. A second
// backward into another poisoned buffer must repeat the first bit for bit
// (no atomics).
TEST_F(CudaTransformer, FlashAttentionMatchesTheCpu) {
  EXPECT_FALSE(cuda::FlashAttentionSupports(DType::kF32, 64));
  EXPECT_FALSE(cuda::FlashAttentionSupports(DType::kBF16, 32));
  int dummy = 0;
  const Status unsupported =
      cuda::FlashAttentionForward(DType::kBF16, &dummy, 1, 8, 2, 2, 32, &dummy, nullptr, s());
  EXPECT_NE(unsupported.message().find("head_dim 32"), std::string::npos) << unsupported.message();
  for (const AttentionCase& c :
       {AttentionCase{2, 100, 4, 2, 64}, AttentionCase{1, 64, 2, 2, 64}, AttentionCase{2, 130, 3, 1, 64},
        AttentionCase{1, 1, 1, 1, 64}, AttentionCase{2, 17, 12, 12, 64}, AttentionCase{1, 65, 12, 4, 64},
        AttentionCase{2, 200, 8, 1, 64}, AttentionCase{1, 128, 2, 2, 64}}) {
    for (const DType dtype : {DType::kBF16, DType::kF16}) {
      const std::string what = fmt::format("batch {} seq {} heads {}/{} {}", c.batch, c.seq, c.heads, c.kv_heads,
                                           DTypeName(dtype));
      const int64_t width = int64_t(c.heads + 2 * c.kv_heads) * c.head_dim, n = int64_t(c.batch) * c.seq;
      const int64_t out_width = int64_t(c.heads) * c.head_dim;
      const Values qkv = Rounded(Random(n * width, 70, 2.0f), dtype);
      const Values dout = Rounded(Random(n * out_width, 71), dtype);
      Values probs(int64_t(c.batch) * c.heads * c.seq * c.seq), out(n * out_width),
          dscores(int64_t(c.seq) * c.seq), dqkv(qkv.size());
      AttentionForward(qkv.data(), c.batch, c.seq, c.heads, c.kv_heads, c.head_dim, probs.data(), out.data());
      AttentionBackward(qkv.data(), probs.data(), dout.data(), c.batch, c.seq, c.heads, c.kv_heads, c.head_dim,
                        dscores.data(), dqkv.data());
      // Each row's log-sum-exp of the scaled scores, in double.
      Values lse(int64_t(c.batch) * c.heads * c.seq);
      const int group = c.heads / c.kv_heads;
      for (int b = 0; b < c.batch; ++b) {
        for (int h = 0; h < c.heads; ++h) {
          for (int i = 0; i < c.seq; ++i) {
            std::vector<double> z(i + 1);
            for (int j = 0; j <= i; ++j) {
              double dot = 0;
              for (int d = 0; d < c.head_dim; ++d) {
                dot += double(qkv[(int64_t(b) * c.seq + i) * width + h * c.head_dim + d]) *
                       qkv[(int64_t(b) * c.seq + j) * width + (c.heads + h / group) * c.head_dim + d];
              }
              z[j] = dot / std::sqrt(double(c.head_dim));
            }
            const double top = *std::max_element(z.begin(), z.end());
            double sum = 0;
            for (double v : z) sum += std::exp(v - top);
            lse[(int64_t(b) * c.heads + h) * c.seq + i] = float(top + std::log(sum));
          }
        }
      }

      const void* d_qkv = UploadAs(qkv, dtype);
      void* d_out = Poisoned(out.size() * DTypeSize(dtype));
      float* d_lse = static_cast<float*>(Poisoned(lse.size() * sizeof(float)));
      ASSERT_OK(cuda::FlashAttentionForward(dtype, d_qkv, c.batch, c.seq, c.heads, c.kv_heads, c.head_dim, d_out,
                                            d_lse, s()));
      EXPECT_LE(RelativeError(DownloadAs(d_out, out.size(), dtype), out), kLowTolerance) << what;
      EXPECT_LE(RelativeError(Download(d_lse, lse.size()), lse), 1e-4) << what;

      float* d_delta = static_cast<float*>(Poisoned(lse.size() * sizeof(float)));
      void* d_dqkv = Poisoned(qkv.size() * DTypeSize(dtype));
      ASSERT_OK(cuda::FlashAttentionBackward(dtype, d_qkv, d_out, UploadAs(dout, dtype), d_lse, c.batch, c.seq,
                                             c.heads, c.kv_heads, c.head_dim, d_delta, d_dqkv, s()));
      const Values got = DownloadAs(d_dqkv, dqkv.size(), dtype);
      for (float v : got) ASSERT_TRUE(std::isfinite(v)) << what << ": an element of dqkv was not written";
      EXPECT_LE(RelativeError(got, dqkv), kLowTolerance) << what;

      void* d_again = Poisoned(qkv.size() * DTypeSize(dtype));
      ASSERT_OK(cuda::FlashAttentionBackward(dtype, d_qkv, d_out, UploadAs(dout, dtype), d_lse, c.batch, c.seq,
                                             c.heads, c.kv_heads, c.head_dim, d_delta, d_again, s()));
      Bits first(qkv.size()), second(qkv.size());
      ASSERT_TRUE(cuda::CopyToHost(first.data(), d_dqkv, first.size() * sizeof(uint16_t), s()).ok());
      ASSERT_TRUE(cuda::CopyToHost(second.data(), d_again, second.size() * sizeof(uint16_t), s()).ok());
      EXPECT_TRUE(first == second) << what << ": a second backward differs from the first";
    }
  }
}

// ---- cross-entropy ---------------------------------------------------------

// Also with ignored targets (-100): the mean is over the scored rows, an
// ignored row's gradient is zero.
TEST_F(CudaTransformer, VocabularyCrossEntropyMatchesTheCpu) {
  const int n = 45, vocab = 5003;
  const Values logits = Random(size_t(n) * vocab, 60, 8.0f);
  for (const bool some_ignored : {false, true}) {
    std::vector<int32_t> targets = RandomIds(n, vocab, 61);
    if (some_ignored) {
      for (int i = 0; i < n; i += 4) targets[size_t(i)] = kIgnoredTarget;
    }
    Values dlogits(logits.size());
    const float loss = CrossEntropyForwardBackward(logits.data(), targets.data(), n, vocab, dlogits.data());
    int32_t* d_targets = Upload(targets);
    for (const DType dtype : {DType::kF32, DType::kBF16}) {
      for (const bool in_place : {false, true}) {
        if (in_place && dtype != DType::kF32) continue;
        float* d_logits = Upload(logits);
        void* d_dlogits = in_place ? static_cast<void*>(d_logits) : Poisoned(logits.size() * DTypeSize(dtype));
        float* d_loss = static_cast<float*>(Poisoned(sizeof(float)));
        const float scale = dtype == DType::kF32 ? 1.0f : 1024.0f;  // the loss scale multiplies only the gradient
        arena_.Reset();
        ASSERT_OK(cuda::CrossEntropyForwardBackward(d_logits, d_targets, n, vocab, d_dlogits, dtype, scale, d_loss,
                                                    arena_, s()));
        EXPECT_LE(std::abs(Download(d_loss, 1)[0] - loss) / loss, kF32Tolerance) << DTypeName(dtype);
        Values got = DownloadAs(d_dlogits, logits.size(), dtype);
        for (float& g : got) g /= scale;
        EXPECT_LE(RelativeError(got, dlogits), Tolerance(dtype)) << DTypeName(dtype) << " in place " << in_place;
        if (some_ignored) {
          EXPECT_EQ(got[1], 0.0f) << "row 0 is ignored: its gradient is zero";
        }
      }
    }
  }
}

}  // namespace
}  // namespace estuary::models
