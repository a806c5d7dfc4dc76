// cuda::LoraLlamaEngine against the CPU models::LoraLlama, which is its
// reference: the same adapter manifest and initial bits; with the same base
// weights and the same random, non-zero A and B, fp32 logits, loss and every
// adapter gradient within 1e-4 relative (per tensor, max|gpu - cpu| /
// max|cpu|) for an untied GQA decoder with all seven projections adapted and a
// tied MHA decoder with q, k, v, o; with PEFT's init (B = 0) the plain
// LlamaEngine's logits and loss bit for bit; five AdamW steps' losses within 1e-4 of
// the CPU's and the base's weights bit for bit unchanged after them; bf16
// losses within 1e-2; a base without its fp32 master exactly the base rounded
// to bf16; and bad configs and inputs refused with one line naming what was
// wrong. Every test skips, naming the reason, without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "models/cuda/device.h"
#include "tests/models/cuda_test_util.h"
#include "models/cuda/llama_engine.h"
#include "models/cuda/lora_engine.h"
#include "models/cuda/optimizer.h"
#include "models/llama.h"
#include "models/lora.h"
#include "models/optimizer.h"
#include "models/precision.h"

namespace estuary::models {
namespace {

using namespace cuda_test;

using Values = std::vector<float>;

double MaxAbs(const float* a, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, double(std::abs(a[i])));
  return m;
}

LoraConfig AllSeven() {
  LoraConfig l;
  l.rank = 4;
  l.alpha = 8;
  l.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  return l;
}

LoraConfig Qkvo() {
  LoraConfig l;
  l.rank = 3;
  l.alpha = 5;
  l.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
  return l;
}

struct Case {
  LlamaConfig config;
  LoraConfig lora;
  const char* name;
};
std::vector<Case> Cases() {
  return {{GqaUntied(), AllSeven(), "untied GQA, 7 projections"}, {MhaTied(), Qkvo(), "tied MHA, q/k/v/o"}};
}

struct Batch {
  int batch, seq;
  std::vector<int32_t> tokens, targets;
};

Batch MakeBatch(const LlamaConfig& c, int batch, int seq, uint32_t seed) {
  std::mt19937 rng(seed);
  Batch b{batch, seq, std::vector<int32_t>(size_t(batch) * seq), std::vector<int32_t>(size_t(batch) * seq)};
  for (int32_t& t : b.tokens) t = int32_t(rng() % uint32_t(c.vocab_size));
  for (int32_t& t : b.targets) t = int32_t(rng() % uint32_t(c.vocab_size));
  return b;
}

cuda::LlamaEngineOptions Options(DType precision) {
  cuda::LlamaEngineOptions o;
  o.precision = precision;
  return o;
}

class CudaLora : public ::testing::Test {
 protected:
  void SetUp() override {
    if (Status s = cuda::CudaUsable(); !s.ok()) GTEST_SKIP() << s.message();
  }
};

// A CPU LoraLlama and a GPU engine with the same seeded base weights and the
// same adapters: uniform(-0.3, 0.3) in A and B alike, so B is not zero (PEFT's
// init would make every adapter a no-op and hide a missing term).
struct Pair {
  LoraLlama cpu;
  cuda::LoraLlamaEngine gpu;
};

Result<Pair> MakePair(const Case& k, int max_batch, cuda::LlamaEngineOptions options = {}, uint64_t seed = 7) {
  ESTUARY_ASSIGN_OR_RETURN(Llama base, Llama::Create(k.config, max_batch));
  base.Initialize(seed);
  ESTUARY_ASSIGN_OR_RETURN(LoraLlama cpu, LoraLlama::Create(std::move(base), k.lora));
  ESTUARY_ASSIGN_OR_RETURN(cuda::LoraLlamaEngine gpu, cuda::LoraLlamaEngine::Create(k.config, k.lora, max_batch, options));
  ESTUARY_RETURN_IF_ERROR(gpu.base().CopyParametersFrom(cpu.base().parameters()));
  std::mt19937 rng(uint32_t(seed) + 1);
  std::uniform_real_distribution<float> uniform(-0.3f, 0.3f);
  for (float& p : cpu.parameters()) p = uniform(rng);
  ESTUARY_RETURN_IF_ERROR(gpu.CopyParametersFrom(cpu.parameters()));
  return Pair{std::move(cpu), std::move(gpu)};
}

TEST_F(CudaLora, ManifestAndInitialAdaptersAreTheCpuModels) {
  for (const Case& k : Cases()) {
    auto pair = MakePair(k, 2);
    ASSERT_TRUE(pair.ok()) << pair.status().ToString();
    EXPECT_TRUE(pair->gpu.manifest() == pair->cpu.manifest()) << k.name;
    EXPECT_EQ(pair->gpu.parameter_count(), int64_t(pair->cpu.parameters().size())) << k.name;
    pair->cpu.Initialize(11);
    ASSERT_OK(pair->gpu.Initialize(11));
    Values adapters(pair->gpu.parameter_count());
    ASSERT_OK(pair->gpu.CopyParametersTo(adapters));
    EXPECT_EQ(std::memcmp(adapters.data(), pair->cpu.parameters().data(), adapters.size() * sizeof(float)), 0)
        << k.name;
    // PEFT's init: every B zero, so the adapted model starts as the base.
    for (const TensorSpec& t : pair->cpu.manifest().tensors) {
      if (t.name.find("lora_B") == std::string::npos) continue;
      EXPECT_TRUE(std::all_of(adapters.begin() + t.offset, adapters.begin() + t.offset + t.numel(),
                              [](float v) { return v == 0.0f; }))
          << t.name;
    }
  }
}

TEST_F(CudaLora, F32LogitsLossAndEveryAdapterGradientMatchTheCpu) {
  for (const Case& k : Cases()) {
    const LlamaConfig& config = k.config;
    auto pair = MakePair(k, 3);
    ASSERT_TRUE(pair.ok()) << pair.status().ToString();
    LoraLlama& cpu = pair->cpu;
    cuda::LoraLlamaEngine& gpu = pair->gpu;
    // The frozen base has no gradient buffer at all.
    EXPECT_EQ(gpu.base().gradients(), nullptr);
    const Batch b = MakeBatch(config, 3, config.max_seq_len - 1, 21);  // not the full context
    const size_t logits_size = size_t(b.batch) * b.seq * config.vocab_size;
    Values cpu_logits(logits_size), gpu_logits(logits_size, std::numeric_limits<float>::quiet_NaN());
    Values base_logits(logits_size);
    ASSERT_OK(cpu.Forward(b.tokens.data(), b.batch, b.seq, cpu_logits.data()));
    ASSERT_OK(gpu.Forward(b.tokens.data(), b.batch, b.seq, gpu_logits.data()));
    EXPECT_LE(RelativeError(gpu_logits.data(), cpu_logits.data(), logits_size), 1e-4) << k.name;
    // The adapters matter here: the base alone is far from the adapted model,
    // so a dropped adapter term could not pass the bound above.
    ASSERT_OK(cpu.base().Forward(b.tokens.data(), b.batch, b.seq, base_logits.data()));
    EXPECT_GE(RelativeError(base_logits.data(), cpu_logits.data(), logits_size), 1e-2) << k.name;

    // Poisoned adapter gradients (NaN bytes): every one must be overwritten.
    ASSERT_OK(cuda::FillBytes(gpu.gradients(), 0xff, size_t(gpu.parameter_count()) * sizeof(float), gpu.stream()));
    const float cpu_loss = Unwrap(cpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
    const float gpu_loss = Unwrap(gpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
    EXPECT_LE(std::abs(gpu_loss - cpu_loss) / cpu_loss, 1e-4) << k.name << ": " << gpu_loss << " vs " << cpu_loss;
    Values grads(gpu.parameter_count(), std::numeric_limits<float>::quiet_NaN());
    ASSERT_OK(gpu.CopyGradientsTo(grads));
    double worst = 0;
    for (const TensorSpec& t : cpu.manifest().tensors) {
      const double error = RelativeError(grads.data() + t.offset, cpu.gradients().data() + t.offset, t.numel());
      EXPECT_LE(error, 1e-4) << k.name << ": " << t.name;
      // A gradient that is all zeros on both sides would prove nothing.
      EXPECT_GT(MaxAbs(cpu.gradients().data() + t.offset, t.numel()), 0.0) << t.name;
      worst = std::max(worst, error);
    }
    std::printf("[ measured ] %s: worst adapter gradient %.2e over %zu tensors\n", k.name, worst,
                cpu.manifest().tensors.size());

    // grad_scale scales every adapter gradient, never the loss.
    ASSERT_OK(gpu.ForwardBackwardAsync(b.tokens.data(), b.targets.data(), b.batch, b.seq, {.grad_scale = 0.25f}));
    EXPECT_EQ(Unwrap(gpu.ReadLoss()), gpu_loss);
    Values quarter(grads.size());
    ASSERT_OK(gpu.CopyGradientsTo(quarter));
    for (size_t i = 0; i < grads.size(); ++i) {
      ASSERT_NEAR(quarter[i], 0.25f * grads[i], 1e-6f * std::abs(grads[i]) + 1e-12f) << "adapter gradient " << i;
    }
  }
}

// With PEFT's init (B = 0) every adapter adds exact zeros, so the frozen
// engine with adapters gives the plain LlamaEngine's logits and loss bit for
// bit, in f32 and bf16: the decoder the adapters hook into is the base's own.
// And dA is zero (it reads B) while dB is not.
TEST_F(CudaLora, ZeroBAdaptersGiveThePlainEnginesResultsBitForBit) {
  for (const DType precision : {DType::kF32, DType::kBF16}) {
    for (const Case& k : Cases()) {
      const LlamaConfig& config = k.config;
      auto plain = cuda::LlamaEngine::Create(config, 2, Options(precision));
      ASSERT_TRUE(plain.ok()) << plain.status().ToString();
      ASSERT_OK(plain->Initialize(5));
      auto lora = cuda::LoraLlamaEngine::Create(config, k.lora, 2, Options(precision));
      ASSERT_TRUE(lora.ok()) << lora.status().ToString();
      ASSERT_OK(lora->base().Initialize(5));
      ASSERT_OK(lora->Initialize(6));
      const Batch b = MakeBatch(config, 2, config.max_seq_len, 51);
      const size_t logits_size = size_t(b.batch) * b.seq * config.vocab_size;
      Values plain_logits(logits_size), lora_logits(logits_size);
      ASSERT_OK(plain->Forward(b.tokens.data(), b.batch, b.seq, plain_logits.data()));
      ASSERT_OK(lora->Forward(b.tokens.data(), b.batch, b.seq, lora_logits.data()));
      EXPECT_EQ(std::memcmp(plain_logits.data(), lora_logits.data(), logits_size * sizeof(float)), 0)
          << k.name << ", " << DTypeName(precision);
      const float plain_loss = Unwrap(plain->ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
      const float lora_loss = Unwrap(lora->ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
      EXPECT_EQ(std::memcmp(&plain_loss, &lora_loss, sizeof(float)), 0)
          << k.name << ", " << DTypeName(precision) << ": " << lora_loss << " vs " << plain_loss;
      Values grads(lora->parameter_count());
      ASSERT_OK(lora->CopyGradientsTo(grads));
      for (const TensorSpec& t : lora->manifest().tensors) {
        const double max = MaxAbs(grads.data() + t.offset, t.numel());
        if (t.name.find("lora_A") != std::string::npos) {
          EXPECT_EQ(max, 0.0) << t.name;
        } else {
          EXPECT_GT(max, 0.0) << t.name;
        }
      }
    }
  }
}

// Recompute under the adapters: each block's forward (adapters included)
// re-run before its backward gives the same loss and adapter gradients bit
// for bit, in f32 and bf16, with fewer activation bytes.
TEST_F(CudaLora, RecomputeGivesThePlainAdapterGradientsBitForBit) {
  for (const DType precision : {DType::kF32, DType::kBF16}) {
    for (const Case& k : Cases()) {
      SCOPED_TRACE(std::string(k.name) + ", " + std::string(DTypeName(precision)));
      cuda::LlamaEngineOptions recompute_options = Options(precision);
      recompute_options.recompute = true;
      auto plain = MakePair(k, 2, Options(precision));
      auto recompute = MakePair(k, 2, recompute_options);
      ASSERT_TRUE(plain.ok()) << plain.status().ToString();
      ASSERT_TRUE(recompute.ok()) << recompute.status().ToString();
      EXPECT_LT(recompute->gpu.base().activation_bytes(), plain->gpu.base().activation_bytes());
      const Batch b = MakeBatch(k.config, 2, k.config.max_seq_len, 61);
      const float p_loss = Unwrap(plain->gpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
      const float r_loss = Unwrap(recompute->gpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
      EXPECT_EQ(std::memcmp(&p_loss, &r_loss, sizeof(float)), 0) << r_loss << " vs " << p_loss;
      Values pg(plain->gpu.parameter_count()), rg(pg.size());
      ASSERT_OK(plain->gpu.CopyGradientsTo(pg));
      ASSERT_OK(recompute->gpu.CopyGradientsTo(rg));
      for (const TensorSpec& t : plain->gpu.manifest().tensors) {
        EXPECT_GT(MaxAbs(pg.data() + t.offset, t.numel()), 0.0) << t.name;
        EXPECT_EQ(std::memcmp(pg.data() + t.offset, rg.data() + t.offset, t.numel() * sizeof(float)), 0) << t.name;
      }
    }
  }
}

// Five AdamW steps on the same batches (the tied case with clipping): the
// losses follow the CPU's, the adapters move, and the base's weights are bit
// for bit what they were. (The adapters themselves are not compared element
// by element: AdamW's m/sqrt(v) turns a rounding-level difference in a
// near-zero gradient into a full step of either sign.)
TEST_F(CudaLora, FiveAdamWStepsFollowTheCpuAndLeaveTheBase) {
  for (const Case& k : Cases()) {
    const LlamaConfig& config = k.config;
    const double clip = config.tie_embeddings ? 0.5 : 0.0;
    auto pair = MakePair(k, 2);
    ASSERT_TRUE(pair.ok()) << pair.status().ToString();
    LoraLlama& cpu = pair->cpu;
    cuda::LoraLlamaEngine& gpu = pair->gpu;
    Values base_before(cpu.base().parameters().size()), base_after(base_before.size());
    ASSERT_OK(gpu.base().CopyParametersTo(base_before));
    const Values adapters_before(cpu.parameters().begin(), cpu.parameters().end());
    AdamWOptions options;
    options.lr = 3e-3f;
    options.weight_decay = 0.01f;
    AdamW cpu_opt(options);
    auto gpu_opt = cuda::AdamW::Create(gpu.parameter_count(), options, gpu.stream());
    ASSERT_TRUE(gpu_opt.ok()) << gpu_opt.status().ToString();
    for (int step = 0; step < 5; ++step) {
      const Batch b = MakeBatch(config, 2, config.max_seq_len, 100 + step);
      const float cpu_loss = Unwrap(cpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
      if (clip > 0) ClipGradNorm(cpu.gradients(), clip);
      cpu_opt.Step(cpu.parameters(), cpu.gradients());
      const float gpu_loss = Unwrap(gpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
      auto stepped = gpu.Step(*gpu_opt, clip);
      ASSERT_TRUE(stepped.ok() && *stepped) << stepped.status().ToString();
      EXPECT_LE(std::abs(gpu_loss - cpu_loss) / cpu_loss, 1e-4) << k.name << ", step " << step;
    }
    EXPECT_EQ(gpu_opt->step_count(), 5);
    ASSERT_OK(gpu.base().CopyParametersTo(base_after));
    EXPECT_EQ(std::memcmp(base_before.data(), base_after.data(), base_before.size() * sizeof(float)), 0) << k.name;
    Values adapters(gpu.parameter_count());
    ASSERT_OK(gpu.CopyParametersTo(adapters));
    EXPECT_GT(RelativeError(adapters.data(), adapters_before.data(), adapters.size()), 1e-3) << k.name;
  }
}

// bf16: the base's and the adapters' GEMMs read bf16 copies; the losses of
// five steps stay within 1e-2 of the fp32 CPU's, the gradients point the CPU's
// way, and the base's fp32 master weights never move.
TEST_F(CudaLora, Bf16LossesAreWithinOnePercentOfTheCpu) {
  for (const Case& k : Cases()) {
    const LlamaConfig& config = k.config;
    auto pair = MakePair(k, 2, Options(DType::kBF16));
    ASSERT_TRUE(pair.ok()) << pair.status().ToString();
    LoraLlama& cpu = pair->cpu;
    cuda::LoraLlamaEngine& gpu = pair->gpu;
    ASSERT_NE(gpu.working_parameters(), nullptr);
    Values base_before(cpu.base().parameters().size()), base_after(base_before.size());
    ASSERT_OK(gpu.base().CopyParametersTo(base_before));
    AdamWOptions options;
    options.lr = 3e-3f;
    AdamW cpu_opt(options);
    auto gpu_opt = cuda::AdamW::Create(gpu.parameter_count(), options, gpu.stream());
    ASSERT_TRUE(gpu_opt.ok()) << gpu_opt.status().ToString();
    for (int step = 0; step < 5; ++step) {
      const Batch b = MakeBatch(config, 2, config.max_seq_len, 300 + step);
      const float cpu_loss = Unwrap(cpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
      const float gpu_loss = Unwrap(gpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
      EXPECT_LE(std::abs(gpu_loss - cpu_loss) / cpu_loss, 1e-2) << k.name << ", step " << step;
      if (step == 0) {
        Values grads(gpu.parameter_count());
        ASSERT_OK(gpu.CopyGradientsTo(grads));
        double dot = 0, a2 = 0, b2 = 0;
        for (size_t i = 0; i < grads.size(); ++i) {
          const double g = grads[i], c = cpu.gradients()[i];
          dot += g * c, a2 += g * g, b2 += c * c;
        }
        EXPECT_GE(dot / std::sqrt(a2 * b2), 0.99) << k.name;
      }
      cpu_opt.Step(cpu.parameters(), cpu.gradients());
      auto stepped = gpu.Step(*gpu_opt);
      ASSERT_TRUE(stepped.ok() && *stepped) << stepped.status().ToString();
    }
    ASSERT_OK(gpu.base().CopyParametersTo(base_after));
    EXPECT_EQ(std::memcmp(base_before.data(), base_after.data(), base_before.size() * sizeof(float)), 0) << k.name;
  }
}

// Without its fp32 master (DropFp32Master under bf16) the base is the base
// rounded to bf16 and nothing else: reading it back gives the rounded
// weights; logits, loss, every adapter gradient and two AdamW steps' losses
// are bit for bit those of an engine whose fp32 master holds the rounded
// weights; and it holds 2 bytes a weight (plus the norms' fp32 copy) where
// that engine holds 6. A base that trains, or one under f32, refuses.
TEST_F(CudaLora, ABaseWithoutItsFp32MasterIsTheBaseRoundedToBf16) {
  for (const Case& k : Cases()) {
    const LlamaConfig& config = k.config;
    auto pair = MakePair(k, 2);
    ASSERT_TRUE(pair.ok()) << pair.status().ToString();
    const std::span<const float> base = pair->cpu.base().parameters();
    std::vector<uint16_t> bits(base.size());
    FloatToBf16(base, bits);
    Values rounded(base.size());
    Bf16ToFloat(bits, rounded);
    size_t norm_values = 0;
    for (const TensorSpec& t : pair->cpu.base().manifest().tensors) norm_values += t.shape.size() == 1 ? t.numel() : 0;

    auto with_master = cuda::LoraLlamaEngine::Create(config, k.lora, 2, Options(DType::kBF16));
    auto without = cuda::LoraLlamaEngine::Create(config, k.lora, 2, Options(DType::kBF16));
    ASSERT_TRUE(with_master.ok() && without.ok()) << with_master.status().ToString() << without.status().ToString();
    ASSERT_OK(with_master->base().CopyParametersFrom(rounded));
    ASSERT_OK(without->base().DropFp32Master());
    ASSERT_OK(without->base().CopyParametersFrom(base));  // rounds on the way in
    ASSERT_OK(with_master->CopyParametersFrom(pair->cpu.parameters()));
    ASSERT_OK(without->CopyParametersFrom(pair->cpu.parameters()));
    EXPECT_TRUE(with_master->base().has_fp32_master());
    EXPECT_FALSE(without->base().has_fp32_master());
    EXPECT_EQ(without->base().parameters(), nullptr);
    const size_t count = base.size();
    EXPECT_EQ(with_master->base().parameter_bytes(), count * 6) << k.name;
    EXPECT_EQ(without->base().parameter_bytes(), count * 2 + norm_values * 4) << k.name;

    Values back(count);
    ASSERT_OK(without->base().CopyParametersTo(back));
    EXPECT_EQ(std::memcmp(back.data(), rounded.data(), count * sizeof(float)), 0) << k.name;

    const Batch b = MakeBatch(config, 2, config.max_seq_len, 71);
    const size_t logits_size = size_t(b.batch) * b.seq * config.vocab_size;
    Values logits_master(logits_size), logits_without(logits_size);
    ASSERT_OK(with_master->Forward(b.tokens.data(), b.batch, b.seq, logits_master.data()));
    ASSERT_OK(without->Forward(b.tokens.data(), b.batch, b.seq, logits_without.data()));
    EXPECT_EQ(std::memcmp(logits_master.data(), logits_without.data(), logits_size * sizeof(float)), 0) << k.name;

    AdamWOptions options;
    options.lr = 3e-3f;
    auto opt_master = cuda::AdamW::Create(with_master->parameter_count(), options, with_master->stream());
    auto opt_without = cuda::AdamW::Create(without->parameter_count(), options, without->stream());
    ASSERT_TRUE(opt_master.ok() && opt_without.ok());
    for (int step = 0; step < 2; ++step) {
      const Batch s = MakeBatch(config, 2, config.max_seq_len, 500 + step);
      const float loss_master = Unwrap(with_master->ForwardBackward(s.tokens.data(), s.targets.data(), 2, s.seq));
      const float loss_without = Unwrap(without->ForwardBackward(s.tokens.data(), s.targets.data(), 2, s.seq));
      EXPECT_EQ(std::memcmp(&loss_master, &loss_without, sizeof(float)), 0)
          << k.name << ", step " << step << ": " << loss_without << " vs " << loss_master;
      if (step == 0) {
        Values g_master(with_master->parameter_count()), g_without(without->parameter_count());
        ASSERT_OK(with_master->CopyGradientsTo(g_master));
        ASSERT_OK(without->CopyGradientsTo(g_without));
        EXPECT_EQ(std::memcmp(g_master.data(), g_without.data(), g_master.size() * sizeof(float)), 0) << k.name;
      }
      ASSERT_TRUE(Unwrap(with_master->Step(*opt_master)));
      ASSERT_TRUE(Unwrap(without->Step(*opt_without)));
    }
    ASSERT_OK(without->base().CopyParametersTo(back));  // the frozen base did not move
    EXPECT_EQ(std::memcmp(back.data(), rounded.data(), count * sizeof(float)), 0) << k.name;
  }
  const LlamaConfig config = MhaTied();
  auto trained = cuda::LlamaEngine::Create(config, 2, Options(DType::kBF16));
  ASSERT_TRUE(trained.ok()) << trained.status().ToString();
  const Status refused = trained->DropFp32Master();
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("frozen"), std::string::npos) << refused.message();
  auto f32 = cuda::LoraLlamaEngine::Create(config, Qkvo(), 2);
  ASSERT_TRUE(f32.ok()) << f32.status().ToString();
  const Status no_copy = f32->base().DropFp32Master();
  EXPECT_FALSE(no_copy.ok());
  EXPECT_NE(no_copy.message().find("f32"), std::string::npos) << no_copy.message();
  EXPECT_TRUE(f32->base().has_fp32_master());
}

// Each refusal is one line that names what was wrong.
void ExpectOneLine(const Status& status, const std::string& needle) {
  ASSERT_FALSE(status.ok()) << "expected a refusal mentioning '" << needle << "'";
  EXPECT_NE(status.message().find(needle), std::string::npos) << status.message();
  EXPECT_EQ(status.message().find('\n'), std::string::npos) << status.message();
}

TEST_F(CudaLora, BadConfigAndInputAreRefusedInOneLine) {
  const LlamaConfig config = GqaUntied();
  LoraConfig dropout = AllSeven();
  dropout.dropout = 0.1f;
  ExpectOneLine(cuda::LoraLlamaEngine::Create(config, dropout, 2).status(), "lora_dropout 0.1");
  ExpectOneLine(cuda::LoraLlamaEngine::Create(config, AllSeven(), 2, Options(DType::kF16)).status(), "f16");
  LoraConfig rank0 = AllSeven();
  rank0.rank = 0;
  ExpectOneLine(cuda::LoraLlamaEngine::Create(config, rank0, 2).status(), "r is 0");
  LoraConfig unknown = Qkvo();
  unknown.target_modules.push_back("qkv_proj");
  ExpectOneLine(cuda::LoraLlamaEngine::Create(config, unknown, 2).status(), "'qkv_proj'");
  cuda::LlamaEngineOptions with_adapters;
  struct Noop : cuda::ProjectionAdapters {
    Status Forward(const cuda::Blas&, int, cuda::Projection, const void*, int, void*, DType) override {
      return Status::Ok();
    }
    Status Backward(const cuda::Blas&, int, cuda::Projection, const void*, const void*, int, void*, DType) override {
      return Status::Ok();
    }
  } noop;
  with_adapters.adapters = &noop;
  ExpectOneLine(cuda::LoraLlamaEngine::Create(config, AllSeven(), 2, with_adapters).status(), "options.adapters");
  ExpectOneLine(cuda::LoraLlamaEngine::Create(config, AllSeven(), 0).status(), "max_batch 0");

  auto engine = cuda::LoraLlamaEngine::Create(config, AllSeven(), 2);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  Batch b = MakeBatch(config, 2, 4, 1);
  b.targets[5] = config.vocab_size;
  ExpectOneLine(engine->ForwardBackward(b.tokens.data(), b.targets.data(), 2, 4).status(),
                "target id 61 at batch 1, position 1");
  ExpectOneLine(engine->ForwardBackward(b.tokens.data(), b.targets.data(), 3, 4).status(), "batch 3 is outside [1, 2]");
  b.targets[5] = 0;
  // DDP's hooks hear once, after backward, that every adapter gradient is final.
  struct Recorder : StepHooks {
    std::vector<uint64_t> offsets;
    void GradientsFinal(uint64_t offset) override { offsets.push_back(offset); }
  } hooks;
  ASSERT_OK(engine->ForwardBackwardAsync(b.tokens.data(), b.targets.data(), 2, 4, {.hooks = &hooks}));
  EXPECT_EQ(hooks.offsets, std::vector<uint64_t>{0});
  auto cpu_base = Llama::Create(config, 2);
  ASSERT_TRUE(cpu_base.ok());
  auto cpu = LoraLlama::Create(std::move(*cpu_base), AllSeven());
  ASSERT_TRUE(cpu.ok());
  const auto units = engine->units(), cpu_units = cpu->units();
  ASSERT_EQ(units.size(), cpu_units.size());
  for (size_t u = 0; u < units.size(); ++u) {
    EXPECT_EQ(units[u].begin, cpu_units[u].begin);
    EXPECT_EQ(units[u].end, cpu_units[u].end);
  }
  ExpectOneLine(engine->ForwardBackwardAsync(b.tokens.data(), b.targets.data(), 2, 4, {.accumulate = true}),
                "accumulate");
  Values wrong(10);
  ExpectOneLine(engine->CopyParametersFrom(wrong), "10 adapter parameters given");
  ExpectOneLine(engine->CopyGradientsTo(wrong), "room for 10 adapter gradients");
  ExpectOneLine(engine->base().CopyGradientsTo(wrong), "frozen");
  auto small = cuda::AdamW::Create(10, {}, engine->stream());
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  ExpectOneLine(engine->Step(*small).status(), "the optimizer holds state for 10 parameters");
  auto base_opt = cuda::AdamW::Create(engine->base().parameter_count(), {}, engine->stream());
  ASSERT_TRUE(base_opt.ok()) << base_opt.status().ToString();
  ExpectOneLine(engine->base().Step(*base_opt).status(), "frozen");
  // After the refusals the engine still trains.
  ASSERT_OK(engine->Initialize(3));
  auto loss = engine->ForwardBackward(b.tokens.data(), b.targets.data(), 2, 4);
  ASSERT_TRUE(loss.ok()) << loss.status().ToString();
  EXPECT_TRUE(std::isfinite(*loss));
}

}  // namespace
}  // namespace estuary::models
