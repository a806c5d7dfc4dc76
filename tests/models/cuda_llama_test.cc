// cuda::LlamaEngine against the CPU decoder models::Llama, which is its
// reference: the same manifest and initial bits; fp32 logits, loss and every
// gradient within 1e-4 relative (per tensor, max|gpu - cpu| / max|cpu|) for a
// GQA model with an untied head and an MHA model with tied embeddings; bf16
// and fp16 losses within 1e-2; ten AdamW steps' losses within 1e-4; an inf
// injected under fp16 leaves every parameter bit and the optimizer untouched;
// and a run saved and reloaded (weights, AdamW state) continues with
// bit-identical losses. Every test skips, naming the reason, without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <cuda_runtime_api.h>

#include <algorithm>

#include "models/cuda/device.h"
#include "tests/models/cuda_test_util.h"
#include "models/cuda/flash_attention.h"
#include "models/cuda/llama_engine.h"
#include "models/cuda/optimizer.h"
#include "models/llama.h"
#include "models/optimizer.h"
#include "models/transformer_ops.h"

namespace estuary::models {
namespace {

using namespace cuda_test;

using Values = std::vector<float>;

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

cuda::LlamaEngineOptions Options(DType precision, float init_scale = 65536.0f) {
  cuda::LlamaEngineOptions o;
  o.precision = precision;
  o.loss_scaler.init_scale = init_scale;
  return o;
}

class CudaLlama : public ::testing::Test {
 protected:
  void SetUp() override {
    if (Status s = cuda::CudaUsable(); !s.ok()) GTEST_SKIP() << s.message();
  }
};

// A CPU model and an engine with the same seeded weights.
struct Pair {
  Llama cpu;
  cuda::LlamaEngine gpu;
};

Result<Pair> MakePair(const LlamaConfig& config, int max_batch, cuda::LlamaEngineOptions options = {},
                      uint64_t seed = 7) {
  ESTUARY_ASSIGN_OR_RETURN(Llama cpu, Llama::Create(config, max_batch));
  ESTUARY_ASSIGN_OR_RETURN(cuda::LlamaEngine gpu, cuda::LlamaEngine::Create(config, max_batch, options));
  cpu.Initialize(seed);
  ESTUARY_RETURN_IF_ERROR(gpu.Initialize(seed));
  return Pair{std::move(cpu), std::move(gpu)};
}

// What the CPU decoder runs and the GPU engine does not implement is refused
// at Create, naming the feature, before any device is touched (so it runs
// without a GPU too).
TEST(CudaLlamaConfig, FeaturesTheEngineLacksAreRefusedByName) {
  LlamaConfig biased = GqaUntied();
  biased.qkv_bias = true;
  auto engine = cuda::LlamaEngine::Create(biased, 1);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().message(),
            "cuda llama: the GPU engine does not implement attention biases (attention_bias, or Qwen2's q/k/v "
            "biases); train this LlamaForCausalLM on the CPU engine");
}

// Response-only training: targets of -100 score nothing. The loss is the
// mean over the scored targets and every gradient follows the CPU's, for a
// batch with some rows partly ignored, one wholly ignored, and a batch in
// which nothing scores (loss 0, gradients 0, not NaN).
TEST_F(CudaLlama, IgnoredTargetsScoreNothingAsOnTheCpu) {
  const LlamaConfig config = GqaUntied();
  auto pair = MakePair(config, 3);
  ASSERT_TRUE(pair.ok()) << pair.status().ToString();
  Batch b = MakeBatch(config, 3, config.max_seq_len - 1, 12);
  for (int i = 0; i < b.seq; ++i) {
    if (i < b.seq / 2) b.targets[size_t(i)] = kIgnoredTarget;  // row 0: the prompt half
    b.targets[size_t(b.seq) + size_t(i)] = kIgnoredTarget;  // row 1: nothing scored
    if (i % 3 == 0) b.targets[2 * size_t(b.seq) + size_t(i)] = kIgnoredTarget;  // row 2: scattered
  }
  for (const bool nothing_scored : {false, true}) {
    if (nothing_scored) std::fill(b.targets.begin(), b.targets.end(), kIgnoredTarget);
    const float cpu_loss = Unwrap(pair->cpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
    const float gpu_loss = Unwrap(pair->gpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
    Values grads(pair->gpu.parameter_count(), std::numeric_limits<float>::quiet_NaN());
    ASSERT_OK(pair->gpu.CopyGradientsTo(grads));
    if (nothing_scored) {
      EXPECT_EQ(cpu_loss, 0.0f);
      EXPECT_EQ(gpu_loss, 0.0f);
      EXPECT_TRUE(std::all_of(grads.begin(), grads.end(), [](float g) { return g == 0.0f; }));
      continue;
    }
    EXPECT_LE(std::abs(gpu_loss - cpu_loss) / cpu_loss, 1e-4) << gpu_loss << " vs " << cpu_loss;
    for (const TensorSpec& t : pair->cpu.manifest().tensors) {
      EXPECT_LE(RelativeError(grads.data() + t.offset, pair->cpu.gradients().data() + t.offset, t.numel()), 1e-4)
          << t.name;
    }
  }
}

// Llama 3's RoPE scaling with an original context short enough that the
// tiny head's four frequencies fall in all three of its bands (kept, scaled,
// and blended between).
LlamaConfig Llama3Scaled() {
  LlamaConfig c = GqaUntied();
  c.rope_scaling.kind = RopeScaling::Kind::kLlama3;
  c.rope_scaling.factor = 8;
  c.rope_scaling.low_freq_factor = 1;
  c.rope_scaling.high_freq_factor = 4;
  c.rope_scaling.original_max_position_embeddings = 16;
  return c;
}

TEST_F(CudaLlama, ManifestAndInitialWeightsAreTheCpuModels) {
  for (const LlamaConfig& config : {GqaUntied(), MhaTied()}) {
    auto pair = MakePair(config, 2);
    ASSERT_TRUE(pair.ok()) << pair.status().ToString();
    EXPECT_TRUE(pair->gpu.manifest() == pair->cpu.manifest());
    Values weights(pair->gpu.parameter_count());
    ASSERT_OK(pair->gpu.CopyParametersTo(weights));
    ASSERT_EQ(weights.size(), pair->cpu.parameters().size());
    EXPECT_EQ(std::memcmp(weights.data(), pair->cpu.parameters().data(), weights.size() * sizeof(float)), 0);
  }
}

TEST_F(CudaLlama, F32LogitsLossAndEveryGradientMatchTheCpu) {
  for (const LlamaConfig& config : {GqaUntied(), MhaTied(), Llama3Scaled()}) {
    auto pair = MakePair(config, 3);
    ASSERT_TRUE(pair.ok()) << pair.status().ToString();
    Llama& cpu = pair->cpu;
    cuda::LlamaEngine& gpu = pair->gpu;
    const Batch b = MakeBatch(config, 3, config.max_seq_len - 1, 11);  // not the full context
    const size_t logits_size = size_t(b.batch) * b.seq * config.vocab_size;
    Values cpu_logits(logits_size), gpu_logits(logits_size, std::numeric_limits<float>::quiet_NaN());
    ASSERT_OK(cpu.Forward(b.tokens.data(), b.batch, b.seq, cpu_logits.data()));
    ASSERT_OK(gpu.Forward(b.tokens.data(), b.batch, b.seq, gpu_logits.data()));
    EXPECT_LE(RelativeError(gpu_logits.data(), cpu_logits.data(), logits_size), 1e-4);

    const float cpu_loss = Unwrap(cpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
    const float gpu_loss = Unwrap(gpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
    EXPECT_LE(std::abs(gpu_loss - cpu_loss) / cpu_loss, 1e-4) << gpu_loss << " vs " << cpu_loss;
    Values grads(gpu.parameter_count(), std::numeric_limits<float>::quiet_NaN());
    ASSERT_OK(gpu.CopyGradientsTo(grads));
    for (const TensorSpec& t : cpu.manifest().tensors) {
      EXPECT_LE(RelativeError(grads.data() + t.offset, cpu.gradients().data() + t.offset, t.numel()), 1e-4)
          << t.name << (config.tie_embeddings ? " (tied)" : " (untied)");
    }
  }
}

TEST_F(CudaLlama, LowPrecisionLossesAreWithinOnePercentOfTheCpu) {
  for (const DType precision : {DType::kBF16, DType::kF16}) {
    for (const LlamaConfig& config : {GqaUntied(), MhaTied()}) {
      auto pair = MakePair(config, 2, Options(precision, 1024.0f));
      ASSERT_TRUE(pair.ok()) << pair.status().ToString();
      const Batch b = MakeBatch(config, 2, config.max_seq_len, 12);
      const float cpu_loss = Unwrap(pair->cpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
      const float gpu_loss = Unwrap(pair->gpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
      EXPECT_LE(std::abs(gpu_loss - cpu_loss) / cpu_loss, 1e-2) << DTypeName(precision);
      // The gradients, unscaled, point the same way as the CPU's.
      Values grads(pair->gpu.parameter_count());
      ASSERT_OK(pair->gpu.CopyGradientsTo(grads));
      const float scale = precision == DType::kF16 ? pair->gpu.loss_scaler().scale() : 1.0f;
      double dot = 0, a2 = 0, b2 = 0;
      for (size_t i = 0; i < grads.size(); ++i) {
        const double g = grads[i] / scale, c = pair->cpu.gradients()[i];
        dot += g * c, a2 += g * g, b2 += c * c;
      }
      EXPECT_GE(dot / std::sqrt(a2 * b2), 0.999) << DTypeName(precision);
    }
  }
}

TEST_F(CudaLlama, TenAdamWStepsFollowTheCpu) {
  const LlamaConfig config = GqaUntied();
  auto pair = MakePair(config, 2);
  ASSERT_TRUE(pair.ok()) << pair.status().ToString();
  AdamWOptions options;
  options.lr = 3e-3f;
  AdamW cpu_opt(options);
  auto gpu_opt = cuda::AdamW::Create(pair->gpu.parameter_count(), options, pair->gpu.stream());
  ASSERT_TRUE(gpu_opt.ok()) << gpu_opt.status().ToString();
  for (int step = 0; step < 10; ++step) {
    const Batch b = MakeBatch(config, 2, config.max_seq_len, 100 + step);
    const float cpu_loss = Unwrap(pair->cpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
    cpu_opt.Step(pair->cpu.parameters(), pair->cpu.gradients());
    const float gpu_loss = Unwrap(pair->gpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
    auto stepped = pair->gpu.Step(*gpu_opt);
    ASSERT_TRUE(stepped.ok() && *stepped) << stepped.status().ToString();
    EXPECT_LE(std::abs(gpu_loss - cpu_loss) / cpu_loss, 1e-4) << "step " << step;
  }
  EXPECT_EQ(gpu_opt->step_count(), 10);
}

TEST_F(CudaLlama, ClippedSgdStepsFollowTheCpu) {
  const LlamaConfig config = MhaTied();
  auto pair = MakePair(config, 2);
  ASSERT_TRUE(pair.ok()) << pair.status().ToString();
  Sgd cpu_opt(0.5f, 0.9f, 1e-4f);
  auto gpu_opt = cuda::Sgd::Create(pair->gpu.parameter_count(), 0.5f, 0.9f, 1e-4f);
  ASSERT_TRUE(gpu_opt.ok()) << gpu_opt.status().ToString();
  for (int step = 0; step < 5; ++step) {
    const Batch b = MakeBatch(config, 2, config.max_seq_len, 200 + step);
    const float cpu_loss = Unwrap(pair->cpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
    ClipGradNorm(pair->cpu.gradients(), 0.1);
    cpu_opt.Step(pair->cpu.parameters(), pair->cpu.gradients());
    const float gpu_loss = Unwrap(pair->gpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
    auto stepped = pair->gpu.Step(*gpu_opt, 0.1);
    ASSERT_TRUE(stepped.ok() && *stepped) << stepped.status().ToString();
    EXPECT_LE(std::abs(gpu_loss - cpu_loss) / cpu_loss, 1e-4) << "step " << step;
  }
}

TEST_F(CudaLlama, F16InfSkipsTheStepAndLeavesEveryParameterBit) {
  const LlamaConfig config = GqaUntied();
  // A modest scale, so that the clean step below cannot overflow by chance.
  auto engine = cuda::LlamaEngine::Create(config, 2, Options(DType::kF16, 1024.0f));
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  ASSERT_OK(engine->Initialize(3));
  auto opt = cuda::AdamW::Create(engine->parameter_count(), {}, engine->stream());
  ASSERT_TRUE(opt.ok()) << opt.status().ToString();
  const Batch b = MakeBatch(config, 2, config.max_seq_len, 13);
  const int64_t count = engine->parameter_count();

  // A clean step runs.
  ASSERT_TRUE(engine->ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq).ok());
  auto stepped = engine->Step(*opt);
  ASSERT_TRUE(stepped.ok() && *stepped) << stepped.status().ToString();

  Values before(count);
  ASSERT_OK(engine->CopyParametersTo(before));
  std::vector<uint16_t> working_before(count), working_after(count);
  ASSERT_OK(cuda::CopyToHost(working_before.data(), engine->working_parameters(), count * 2, engine->stream()));
  const float scale = engine->loss_scaler().scale();

  ASSERT_TRUE(engine->ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq).ok());
  const float inf = std::numeric_limits<float>::infinity();
  ASSERT_OK(cuda::CopyToDevice(engine->gradients() + count / 2, &inf, sizeof inf, engine->stream()));
  stepped = engine->Step(*opt);
  ASSERT_TRUE(stepped.ok()) << stepped.status().ToString();
  EXPECT_FALSE(*stepped);
  EXPECT_EQ(opt->step_count(), 1);
  EXPECT_EQ(engine->loss_scaler().scale(), scale * 0.5f);

  Values after(count);
  ASSERT_OK(engine->CopyParametersTo(after));
  ASSERT_OK(cuda::CopyToHost(working_after.data(), engine->working_parameters(), count * 2, engine->stream()));
  EXPECT_EQ(std::memcmp(before.data(), after.data(), count * sizeof(float)), 0);
  EXPECT_EQ(working_before, working_after);

  // An overflow the model makes itself: a loss scale of 2^60 turns the fp16
  // gradients to inf.
  auto huge = cuda::LlamaEngine::Create(config, 2, Options(DType::kF16, 0x1p60f));
  ASSERT_TRUE(huge.ok()) << huge.status().ToString();
  ASSERT_OK(huge->Initialize(3));
  auto huge_opt = cuda::AdamW::Create(count, {}, huge->stream());
  ASSERT_TRUE(huge_opt.ok());
  ASSERT_OK(huge->CopyParametersTo(before));
  ASSERT_TRUE(huge->ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq).ok());
  stepped = huge->Step(*huge_opt);
  ASSERT_TRUE(stepped.ok());
  EXPECT_FALSE(*stepped);
  ASSERT_OK(huge->CopyParametersTo(after));
  EXPECT_EQ(std::memcmp(before.data(), after.data(), count * sizeof(float)), 0);
}

// Train three steps, save weights and optimizer state, train three more; a
// fresh engine loaded from the save must give the same three losses, bit for bit.
TEST_F(CudaLlama, SaveReloadContinueIsBitIdentical) {
  for (const DType precision : {DType::kF32, DType::kBF16}) {
    const LlamaConfig config = GqaUntied();
    auto a = cuda::LlamaEngine::Create(config, 2, Options(precision));
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    ASSERT_OK(a->Initialize(5));
    const int64_t count = a->parameter_count();
    auto opt_a = cuda::AdamW::Create(count, {}, a->stream());
    ASSERT_TRUE(opt_a.ok());
    auto train = [&](cuda::LlamaEngine& engine, cuda::AdamW& opt, int step) {
      const Batch b = MakeBatch(config, 2, config.max_seq_len, 300 + step);
      const float loss = Unwrap(engine.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq));
      auto stepped = engine.Step(opt);
      EXPECT_TRUE(stepped.ok() && *stepped);
      return loss;
    };
    for (int step = 0; step < 3; ++step) train(*a, *opt_a, step);
    Values weights(count), m(count), v(count);
    ASSERT_OK(a->CopyParametersTo(weights));
    ASSERT_OK(opt_a->SaveState(m, v, a->stream()));
    std::vector<float> continued;
    for (int step = 3; step < 6; ++step) continued.push_back(train(*a, *opt_a, step));

    auto b = cuda::LlamaEngine::Create(config, 2, Options(precision));
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    ASSERT_OK(b->CopyParametersFrom(weights));
    auto opt_b = cuda::AdamW::Create(count, {}, b->stream());
    ASSERT_TRUE(opt_b.ok());
    ASSERT_OK(opt_b->LoadState(m, v, 3, b->stream()));
    for (int step = 3; step < 6; ++step) {
      const float loss = train(*b, *opt_b, step);
      EXPECT_EQ(std::memcmp(&loss, &continued[step - 3], sizeof loss), 0)
          << DTypeName(precision) << " step " << step << ": " << loss << " vs " << continued[step - 3];
    }
  }
}

// What DDP relies on (models/step_hooks.h): the units are the CPU model's;
// GradientsFinal reports each unit's start as its backward is enqueued, in
// decreasing order and ending at 0, exactly where the CPU model reports
// them; grad_scale scales every gradient and not the loss; accumulate is
// refused with one line; and an engine on a caller's stream runs there.
TEST_F(CudaLlama, DataParallelOptionsFollowTheCpuModel) {
  struct Recorder : StepHooks {
    std::vector<uint64_t> offsets;
    void GradientsFinal(uint64_t offset) override { offsets.push_back(offset); }
  };
  for (const LlamaConfig& config : {GqaUntied(), MhaTied()}) {
    struct OwnedStream {
      cudaStream_t stream = nullptr;
      ~OwnedStream() { cudaStreamDestroy(stream); }
    } owned;  // declared before the engine, so destroyed after it
    ASSERT_EQ(cudaStreamCreateWithFlags(&owned.stream, cudaStreamNonBlocking), cudaSuccess);
    const cudaStream_t stream = owned.stream;
    cuda::LlamaEngineOptions options;
    options.stream = stream;
    auto pair = MakePair(config, 2, options);
    ASSERT_TRUE(pair.ok()) << pair.status().ToString();
    EXPECT_EQ(pair->gpu.stream(), stream);
    const auto cpu_units = pair->cpu.units(), gpu_units = pair->gpu.units();
    ASSERT_EQ(gpu_units.size(), cpu_units.size());
    for (size_t u = 0; u < cpu_units.size(); ++u) {
      EXPECT_EQ(gpu_units[u].name, cpu_units[u].name);
      EXPECT_EQ(gpu_units[u].begin, cpu_units[u].begin);
      EXPECT_EQ(gpu_units[u].end, cpu_units[u].end);
    }
    const Batch b = MakeBatch(config, 2, config.max_seq_len, 41);
    ASSERT_OK(pair->gpu.ForwardBackwardAsync(b.tokens.data(), b.targets.data(), b.batch, b.seq));
    auto plain_loss = pair->gpu.ReadLoss();
    ASSERT_TRUE(plain_loss.ok());
    Values plain(pair->gpu.parameter_count()), scaled(plain.size());
    ASSERT_OK(pair->gpu.CopyGradientsTo(plain));

    Recorder gpu_hooks, cpu_hooks;
    BackwardOptions quarter{.grad_scale = 0.25f, .hooks = &gpu_hooks};
    ASSERT_OK(pair->gpu.ForwardBackwardAsync(b.tokens.data(), b.targets.data(), b.batch, b.seq, quarter));
    auto loss = pair->gpu.ReadLoss();
    ASSERT_TRUE(loss.ok());
    EXPECT_EQ(*loss, *plain_loss);  // the loss is the plain mean
    ASSERT_OK(pair->gpu.CopyGradientsTo(scaled));
    for (size_t i = 0; i < plain.size(); ++i) {
      ASSERT_NEAR(scaled[i], 0.25f * plain[i], 1e-6f * std::abs(plain[i]) + 1e-12f) << "gradient element " << i;
    }
    (void)pair->cpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq,
                                    BackwardOptions{.hooks = &cpu_hooks});
    ASSERT_FALSE(gpu_hooks.offsets.empty());
    EXPECT_EQ(gpu_hooks.offsets.back(), 0u);
    for (size_t i = 1; i < gpu_hooks.offsets.size(); ++i) EXPECT_LT(gpu_hooks.offsets[i], gpu_hooks.offsets[i - 1]);
    // Every offset the engine reports, the CPU model reports too (it may
    // report more: the untied LM head apart from the final norm).
    for (uint64_t offset : gpu_hooks.offsets) {
      EXPECT_NE(std::find(cpu_hooks.offsets.begin(), cpu_hooks.offsets.end(), offset), cpu_hooks.offsets.end())
          << "offset " << offset;
    }
    EXPECT_EQ(gpu_hooks.offsets.size(), size_t(config.num_layers) + 2);

    const Status refused = pair->gpu.ForwardBackwardAsync(b.tokens.data(), b.targets.data(), b.batch, b.seq,
                                                          BackwardOptions{.accumulate = true});
    EXPECT_FALSE(refused.ok());
    EXPECT_NE(refused.message().find("accumulate"), std::string::npos) << refused.message();
  }
}

// Asked to, under bf16 with head_dim 64, the engine attends with the fused
// kernels (flash_attention.h): the loss stays within 1e-2 of the fp32 CPU model's,
// and loss and gradients follow the engine's materialised path; three AdamW
// steps later the losses still agree.
TEST_F(CudaLlama, FlashAttentionFollowsTheMaterialisedPath) {
  LlamaConfig config;
  config.vocab_size = 97;
  config.hidden_size = 128;
  config.intermediate_size = 160;
  config.num_layers = 2;
  config.num_heads = 2;
  config.num_kv_heads = 1;
  config.max_seq_len = 96;
  ASSERT_EQ(config.head_dim(), 64);
  ASSERT_TRUE(cuda::FlashAttentionSupports(DType::kBF16, config.head_dim()));
  cuda::LlamaEngineOptions flash = Options(DType::kBF16), plain = Options(DType::kBF16);
  flash.flash_attention = true;
  plain.flash_attention = false;  // whatever the default
  auto fused = MakePair(config, 3, flash);
  ASSERT_TRUE(fused.ok()) << fused.status().ToString();
  auto materialised = cuda::LlamaEngine::Create(config, 3, plain);
  ASSERT_TRUE(materialised.ok()) << materialised.status().ToString();
  ASSERT_OK(materialised->Initialize(7));
  EXPECT_LT(fused->gpu.activation_bytes(), materialised->activation_bytes());

  auto f_opt = cuda::AdamW::Create(fused->gpu.parameter_count(), {.lr = 1e-3f}, fused->gpu.stream());
  auto m_opt = cuda::AdamW::Create(materialised->parameter_count(), {.lr = 1e-3f}, materialised->stream());
  ASSERT_TRUE(f_opt.ok() && m_opt.ok());
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const Batch b = MakeBatch(config, 3, 90, 300 + step);  // 90 tokens: a query tile ends mid-tile
    auto f_loss = fused->gpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq);
    auto m_loss = materialised->ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq);
    ASSERT_TRUE(f_loss.ok()) << f_loss.status().ToString();
    ASSERT_TRUE(m_loss.ok()) << m_loss.status().ToString();
    EXPECT_LE(std::abs(*f_loss - *m_loss), 1e-2 * std::abs(*m_loss)) << *f_loss << " vs " << *m_loss;
    if (step == 0) {
      const float cpu_loss = fused->cpu.ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq).value();
      EXPECT_LE(std::abs(*f_loss - cpu_loss), 1e-2 * std::abs(cpu_loss)) << *f_loss << " vs " << cpu_loss;
      Values fg(fused->gpu.parameter_count()), mg(fg.size());
      ASSERT_OK(fused->gpu.CopyGradientsTo(fg));
      ASSERT_OK(materialised->CopyGradientsTo(mg));
      for (const TensorSpec& t : fused->gpu.manifest().tensors) {
        EXPECT_LE(RelativeError(fg.data() + t.offset, mg.data() + t.offset, t.numel()), 3e-2) << t.name;
      }
    }
    ASSERT_TRUE(fused->gpu.Step(*f_opt).ok());
    ASSERT_TRUE(materialised->Step(*m_opt).ok());
  }
}

// Activation recompute re-runs each block's forward with the same kernels on
// the same inputs before its backward: the same loss and every gradient bit
// for bit over AdamW steps, materialised attention (f32) and fused (bf16),
// with one block's activations where the plain engine keeps three.
TEST_F(CudaLlama, RecomputeTakesThePlainStepsBitForBitInFewerActivationBytes) {
  LlamaConfig config;
  config.vocab_size = 97;
  config.hidden_size = 128;
  config.intermediate_size = 160;
  config.num_layers = 3;
  config.num_heads = 2;
  config.num_kv_heads = 1;
  config.max_seq_len = 64;
  for (const DType precision : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(precision));
    cuda::LlamaEngineOptions plain_options = Options(precision), recompute_options = plain_options;
    recompute_options.recompute = true;
    auto plain = cuda::LlamaEngine::Create(config, 2, plain_options);
    auto recompute = cuda::LlamaEngine::Create(config, 2, recompute_options);
    ASSERT_TRUE(plain.ok()) << plain.status().ToString();
    ASSERT_TRUE(recompute.ok()) << recompute.status().ToString();
    EXPECT_FALSE(plain->recompute());
    EXPECT_TRUE(recompute->recompute());
    EXPECT_LT(recompute->activation_bytes(), plain->activation_bytes());
    ASSERT_OK(plain->Initialize(7));
    ASSERT_OK(recompute->Initialize(7));
    auto p_opt = cuda::AdamW::Create(plain->parameter_count(), {.lr = 1e-3f}, plain->stream());
    auto r_opt = cuda::AdamW::Create(recompute->parameter_count(), {.lr = 1e-3f}, recompute->stream());
    ASSERT_TRUE(p_opt.ok() && r_opt.ok());
    Values pg(plain->parameter_count()), rg(pg.size());
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      const Batch b = MakeBatch(config, 2, 60, 700 + step);
      const float p_loss = plain->ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq).value();
      const float r_loss = recompute->ForwardBackward(b.tokens.data(), b.targets.data(), b.batch, b.seq).value();
      EXPECT_EQ(std::memcmp(&p_loss, &r_loss, sizeof(float)), 0) << r_loss << " vs " << p_loss;
      ASSERT_OK(plain->CopyGradientsTo(pg));
      ASSERT_OK(recompute->CopyGradientsTo(rg));
      for (const TensorSpec& t : plain->manifest().tensors) {
        EXPECT_EQ(std::memcmp(pg.data() + t.offset, rg.data() + t.offset, t.numel() * sizeof(float)), 0) << t.name;
      }
      ASSERT_TRUE(plain->Step(*p_opt).ok());
      ASSERT_TRUE(recompute->Step(*r_opt).ok());
    }
  }
}

TEST_F(CudaLlama, BadInputIsRejectedNamingWhatAndWhere) {
  const LlamaConfig config = GqaUntied();
  auto engine = cuda::LlamaEngine::Create(config, 2);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  Batch b = MakeBatch(config, 2, 4, 1);
  b.targets[5] = config.vocab_size;
  auto loss = engine->ForwardBackward(b.tokens.data(), b.targets.data(), 2, 4);
  ASSERT_FALSE(loss.ok());
  EXPECT_NE(loss.status().message().find("target id 61 at batch 1, position 1"), std::string::npos)
      << loss.status().message();
  b.targets[5] = -101;  // -100 is the only negative target that means anything
  loss = engine->ForwardBackward(b.tokens.data(), b.targets.data(), 2, 4);
  ASSERT_FALSE(loss.ok());
  EXPECT_NE(loss.status().message().find("target id -101 at batch 1, position 1"), std::string::npos)
      << loss.status().message();
  b.targets[5] = 0;
  loss = engine->ForwardBackward(b.tokens.data(), b.targets.data(), 3, 4);
  ASSERT_FALSE(loss.ok());
  EXPECT_NE(loss.status().message().find("batch 3 is outside [1, 2]"), std::string::npos);
  Values wrong(10);
  EXPECT_FALSE(engine->CopyParametersFrom(wrong).ok());
  cuda::LlamaEngineOptions tf32_bf16 = Options(DType::kBF16);
  tf32_bf16.allow_tf32 = true;
  auto bad = cuda::LlamaEngine::Create(config, 2, tf32_bf16);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("allow_tf32"), std::string::npos);
}

}  // namespace
}  // namespace estuary::models
