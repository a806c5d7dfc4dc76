// Cached generation on the GPU (models/cuda/llama_decoder.h) against the CPU
// model and the GPU engine's own full forward: under f32 every step's logits
// (a prefill, then one token at a time) within 1e-4 of both, for GQA models
// with an untied and a tied head, one whose head_dim (40) spans two lanes of
// the attention kernel's warp and leaves some idle, and one with Llama 3's
// RoPE scaling; under bf16 within a few
// 1e-2 of the CPU, and greedy tokens the GPU full forward's argmax wherever
// its top two logits are not within that rounding; a chunk after the prompt
// continuing the cache; seeded sampling and stop tokens through
// models::Generate; a LoRA engine's base decoding the adapted model; bad input
// refused in one line; and the decoder reporting the device it runs on. Every
// test skips, naming the reason, without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "models/cuda/device.h"
#include "models/cuda/llama_decoder.h"
#include "models/cuda/llama_engine.h"
#include "models/cuda/lora_engine.h"
#include "models/generate.h"
#include "models/llama.h"
#include "models/lora.h"
#include "models/sampling.h"
#include "tests/models/cuda_test_util.h"

namespace estuary::models {
namespace {

using namespace cuda_test;
using Values = std::vector<float>;

enum class Variant { kUntied, kTied, kWideHeads, kRopeScaling };

LlamaConfig ConfigOf(Variant variant) {
  LlamaConfig c{.vocab_size = 97, .hidden_size = 32, .intermediate_size = 48, .num_layers = 3, .num_heads = 4,
                .num_kv_heads = 2, .max_seq_len = 48, .tie_embeddings = variant == Variant::kTied};
  if (variant == Variant::kWideHeads) {
    // head_dim 40: lanes 0-7 hold two dimensions, the rest one.
    c.hidden_size = 80;
    c.num_heads = 2;
    c.num_kv_heads = 1;
  }
  if (variant == Variant::kRopeScaling) {
    // Llama 3's: the decoder reads the engine's scaled tables at an offset.
    c.rope_scaling = {.kind = RopeScaling::Kind::kLlama3, .factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
                      .original_max_position_embeddings = 32};
  }
  return c;
}

// A CPU model with the init's weights times `scale`, and a GPU engine holding
// the same weights. Under f32, x3 (as generate_test's), so that disagreements
// are not hidden by tiny activations; bf16 tests keep the init's scale, under
// which a numpy emulation of bf16's roundings puts the logits within 7.3e-3
// of fp32's (x3 compounds them to 6e-2 over three blocks).
struct Pair {
  Llama cpu;
  cuda::LlamaEngine gpu;
};

Result<Pair> MakePair(Variant variant, DType precision, float scale = 3, uint64_t seed = 3) {
  const LlamaConfig config = ConfigOf(variant);
  ESTUARY_ASSIGN_OR_RETURN(Llama cpu, Llama::Create(config, 1));
  cpu.Initialize(seed);
  for (float& p : cpu.parameters()) p *= scale;
  ESTUARY_ASSIGN_OR_RETURN(cuda::LlamaEngine gpu, cuda::LlamaEngine::Create(config, 1, {.precision = precision}));
  ESTUARY_RETURN_IF_ERROR(gpu.CopyParametersFrom(cpu.parameters()));
  return Pair{std::move(cpu), std::move(gpu)};
}

// The last rows of full forwards over `tokens`: the logits that follow them.
Values CpuNext(Llama& model, const std::vector<int32_t>& tokens) {
  const int V = model.config().vocab_size, seq = int(tokens.size());
  Values logits(size_t(seq) * V);
  EXPECT_TRUE(model.Forward(tokens.data(), 1, seq, logits.data()).ok());
  return {logits.end() - V, logits.end()};
}
Values GpuNext(cuda::LlamaEngine& engine, const std::vector<int32_t>& tokens) {
  const int V = engine.config().vocab_size, seq = int(tokens.size());
  Values logits(size_t(seq) * V, std::numeric_limits<float>::quiet_NaN());
  const Status s = engine.Forward(tokens.data(), 1, seq, logits.data());
  EXPECT_TRUE(s.ok()) << s.ToString();
  return {logits.end() - V, logits.end()};
}

double Error(const Values& a, const Values& b) {
  EXPECT_EQ(a.size(), b.size());
  return RelativeError(a.data(), b.data(), std::min(a.size(), b.size()));
}

const std::vector<int32_t> kPrompt = {5, 17, 42, 8, 91, 3};
constexpr double kF32Tolerance = 1e-4;
// bf16 rounds every GEMM input and output and the kept keys and values to 8
// bits of mantissa (2^-9 relative); three blocks compound that (to 7.3e-3 in
// the emulation, see MakePair).
constexpr double kBf16Tolerance = 2e-2;

class CudaGenerate : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    if (Status s = cuda::CudaUsable(); !s.ok()) GTEST_SKIP() << s.message();
  }
};
INSTANTIATE_TEST_SUITE_P(Decoders, CudaGenerate,
                         ::testing::Values(Variant::kUntied, Variant::kTied, Variant::kWideHeads,
                                           Variant::kRopeScaling),
                         [](const auto& info) {
                           switch (info.param) {
                             case Variant::kUntied: return "GqaUntied";
                             case Variant::kTied: return "GqaTied";
                             case Variant::kWideHeads: return "HeadDim40";
                             case Variant::kRopeScaling: return "Llama3RopeScaling";
                           }
                           return "";
                         });

// Prefill, then 30 sampled tokens one at a time: every step's logits are the
// CPU's and the GPU engine's full forward over the sequence so far.
TEST_P(CudaGenerate, F32EveryStepGivesTheFullForwardsLogits) {
  auto pair = MakePair(GetParam(), DType::kF32);
  ASSERT_TRUE(pair.ok()) << pair.status().ToString();
  auto decoder = cuda::LlamaDecoder::Create(pair->gpu);
  ASSERT_TRUE(decoder.ok()) << decoder.status().ToString();
  std::vector<int32_t> sequence = kPrompt;
  Values logits(pair->cpu.config().vocab_size, std::numeric_limits<float>::quiet_NaN());
  ASSERT_OK(decoder->Append(sequence, logits));
  TokenSampler sampler({.temperature = 1.0, .seed = 11});
  for (int step = 0; step <= 30; ++step) {
    if (step > 0) ASSERT_OK(decoder->Append(std::span(&sequence.back(), 1), logits));
    ASSERT_EQ(decoder->length(), int(sequence.size()));
    EXPECT_LE(Error(logits, CpuNext(pair->cpu, sequence)), kF32Tolerance) << "step " << step;
    EXPECT_LE(Error(logits, GpuNext(pair->gpu, sequence)), kF32Tolerance) << "step " << step;
    sequence.push_back(sampler.Next(logits));
  }
  // Generate on either decoder samples alike from (nearly) the same logits:
  // greedy picks the same tokens, and their log-probabilities agree.
  const GenerateOptions greedy{.max_new_tokens = 25, .sampling = {.temperature = 0}};
  auto on_gpu = Generate(*decoder, kPrompt, greedy);
  auto on_cpu = Generate(pair->cpu, kPrompt, greedy);
  ASSERT_TRUE(on_gpu.ok() && on_cpu.ok()) << on_gpu.status().ToString() << on_cpu.status().ToString();
  EXPECT_EQ(on_gpu->tokens, on_cpu->tokens);
  ASSERT_EQ(on_gpu->log_probs.size(), on_cpu->log_probs.size());
  for (size_t i = 0; i < on_gpu->log_probs.size(); ++i) EXPECT_NEAR(on_gpu->log_probs[i], on_cpu->log_probs[i], 1e-4);
}

// Under bf16 the decoder's logits are the CPU's within bf16's rounding, and
// each greedy token is the GPU full forward's argmax; where that forward's
// top two logits lie within the rounding of each other, either may win, and
// the token must then be one of the near-ties.
TEST_P(CudaGenerate, Bf16GreedyFollowsTheFullForwardsArgmax) {
  auto pair = MakePair(GetParam(), DType::kBF16, /*scale=*/1);
  ASSERT_TRUE(pair.ok()) << pair.status().ToString();
  auto decoder = cuda::LlamaDecoder::Create(pair->gpu);
  ASSERT_TRUE(decoder.ok()) << decoder.status().ToString();
  const int V = pair->cpu.config().vocab_size;
  std::vector<int32_t> sequence = kPrompt;
  Values logits(V, std::numeric_limits<float>::quiet_NaN());
  ASSERT_OK(decoder->Append(sequence, logits));
  std::vector<int32_t> greedy;
  int strict = 0;
  for (int step = 0; step < 30; ++step) {
    if (step > 0) ASSERT_OK(decoder->Append(std::span(&sequence.back(), 1), logits));
    EXPECT_LE(Error(logits, CpuNext(pair->cpu, sequence)), kBf16Tolerance) << "step " << step;
    const Values full = GpuNext(pair->gpu, sequence);
    EXPECT_LE(Error(logits, full), kBf16Tolerance) << "step " << step;
    const int32_t token = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    Values sorted = full;
    std::sort(sorted.begin(), sorted.end(), std::greater<float>());
    double scale = 0;
    for (float v : full) scale = std::max(scale, double(std::abs(v)));
    const double margin = kBf16Tolerance * scale;
    const int32_t top = int32_t(std::max_element(full.begin(), full.end()) - full.begin());
    EXPECT_GE(full[token], sorted[0] - 2 * margin) << "step " << step << ": token " << token << " vs argmax " << top;
    if (sorted[0] - sorted[1] > 2 * margin) {
      EXPECT_EQ(token, top) << "step " << step;
      ++strict;
    }
    greedy.push_back(token);
    sequence.push_back(token);
  }
  // Not vacuous: most steps have a clear winner (two thirds to all of them in
  // the emulation).
  EXPECT_GE(strict, 10);
  // The decoder repeats itself bit for bit, so Generate's greedy run is the loop's.
  auto out = Generate(*decoder, kPrompt, {.max_new_tokens = 30, .sampling = {.temperature = 0}});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->tokens, greedy);
  EXPECT_EQ(decoder->device().substr(decoder->device().rfind(' ')), " bf16");
  std::printf("bf16 %s: %d of 30 greedy steps had a clear argmax and matched it\n", decoder->device().c_str(), strict);
}

// Several tokens appended at once continue a cached sequence as one does; a
// cleared decoder starts over at position 0.
TEST_P(CudaGenerate, AChunkAfterThePromptContinuesTheCache) {
  auto pair = MakePair(GetParam(), DType::kF32);
  ASSERT_TRUE(pair.ok()) << pair.status().ToString();
  auto decoder = cuda::LlamaDecoder::Create(pair->gpu);
  auto whole = cuda::LlamaDecoder::Create(pair->gpu);
  ASSERT_TRUE(decoder.ok() && whole.ok());
  const int V = pair->cpu.config().vocab_size;
  Values logits(V), at_once(V);
  const std::vector<int32_t> chunk = {60, 2, 33, 33, 70};
  ASSERT_OK(decoder->Append(kPrompt, logits));
  ASSERT_OK(decoder->Append(chunk, logits));
  EXPECT_EQ(decoder->length(), int(kPrompt.size() + chunk.size()));
  std::vector<int32_t> sequence = kPrompt;
  sequence.insert(sequence.end(), chunk.begin(), chunk.end());
  ASSERT_OK(whole->Append(sequence, at_once));
  EXPECT_LE(Error(logits, at_once), kF32Tolerance);
  EXPECT_LE(Error(logits, CpuNext(pair->cpu, sequence)), kF32Tolerance);
  decoder->Clear();
  EXPECT_EQ(decoder->length(), 0);
  ASSERT_OK(decoder->Append(chunk, logits));
  EXPECT_LE(Error(logits, CpuNext(pair->cpu, chunk)), kF32Tolerance);
}

TEST_P(CudaGenerate, TheSameSeedGivesTheSameTokensAndAStopTokenEnds) {
  auto pair = MakePair(GetParam(), DType::kBF16);
  ASSERT_TRUE(pair.ok()) << pair.status().ToString();
  auto decoder = cuda::LlamaDecoder::Create(pair->gpu);
  ASSERT_TRUE(decoder.ok()) << decoder.status().ToString();
  SamplingOptions sampling{.temperature = 1.3, .top_k = 40, .top_p = 0.95, .seed = 5};
  auto first = Generate(*decoder, kPrompt, {.max_new_tokens = 25, .sampling = sampling});
  auto again = Generate(*decoder, kPrompt, {.max_new_tokens = 25, .sampling = sampling});
  sampling.seed = 6;
  auto reseeded = Generate(*decoder, kPrompt, {.max_new_tokens = 25, .sampling = sampling});
  ASSERT_TRUE(first.ok() && again.ok() && reseeded.ok()) << first.status().ToString();
  EXPECT_EQ(first->tokens, again->tokens);
  EXPECT_EQ(first->log_probs, again->log_probs);
  EXPECT_NE(first->tokens, reseeded->tokens);

  auto free_run = Generate(*decoder, kPrompt, {.max_new_tokens = 30, .sampling = {.temperature = 0}});
  ASSERT_TRUE(free_run.ok());
  ASSERT_EQ(free_run->tokens.size(), 30u);
  EXPECT_FALSE(free_run->stopped);
  const int32_t stop = free_run->tokens[7];
  const auto& run = free_run->tokens;
  const size_t first_stop = std::find(run.begin(), run.end(), stop) - run.begin();
  auto stopped = Generate(*decoder, kPrompt, {.max_new_tokens = 30, .sampling = {.temperature = 0},
                                              .stop_tokens = {1000, stop}});
  ASSERT_TRUE(stopped.ok());
  EXPECT_TRUE(stopped->stopped);
  EXPECT_EQ(stopped->tokens,
            std::vector<int32_t>(free_run->tokens.begin(), free_run->tokens.begin() + first_stop + 1));
}

// The decoder built on a LoRA engine's base calls its adapters as the
// engine's forward does: it decodes the adapted model, whose CPU twin is
// LoraLlama::Merged().
TEST(CudaGenerateLora, ALoraEnginesBaseDecodesTheAdaptedModel) {
  if (Status s = cuda::CudaUsable(); !s.ok()) GTEST_SKIP() << s.message();
  const LlamaConfig config = ConfigOf(Variant::kUntied);
  auto base = Llama::Create(config, 1);
  ASSERT_TRUE(base.ok());
  base->Initialize(4);
  for (float& p : base->parameters()) p *= 3;
  const Values base_weights(base->parameters().begin(), base->parameters().end());
  // Every projection adapted, so each of the decoder's four adapter calls counts.
  const LoraConfig lora{
      .rank = 2, .alpha = 4,
      .target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}};
  auto adapted = LoraLlama::Create(std::move(*base), lora);
  ASSERT_TRUE(adapted.ok()) << adapted.status().ToString();
  std::mt19937_64 rng(8);
  for (float& p : adapted->parameters()) p = float(0.4 * (double(rng() >> 11) * 0x1.0p-53 - 0.5));
  auto merged = adapted->Merged();
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();
  auto engine = cuda::LoraLlamaEngine::Create(config, lora, 1);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  ASSERT_OK(engine->base().CopyParametersFrom(base_weights));
  ASSERT_OK(engine->CopyParametersFrom(adapted->parameters()));
  auto decoder = cuda::LlamaDecoder::Create(engine->base());
  ASSERT_TRUE(decoder.ok()) << decoder.status().ToString();
  std::vector<int32_t> sequence = kPrompt;
  Values logits(config.vocab_size);
  ASSERT_OK(decoder->Append(sequence, logits));
  for (int step = 0; step < 8; ++step) {
    if (step > 0) ASSERT_OK(decoder->Append(std::span(&sequence.back(), 1), logits));
    const Values expected = CpuNext(*merged, sequence);
    EXPECT_LE(Error(logits, expected), kF32Tolerance) << "step " << step;
    sequence.push_back(int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin()));
  }
  // The adapters matter: the plain base's logits after the same tokens differ.
  sequence.pop_back();  // the last pick was never appended
  auto plain = Llama::Create(config, 1);
  ASSERT_TRUE(plain.ok());
  std::copy(base_weights.begin(), base_weights.end(), plain->parameters().begin());
  EXPECT_GT(Error(logits, CpuNext(*plain, sequence)), 1e-2);
}

TEST(CudaGenerateErrors, BadInputIsRefusedInOneLine) {
  if (Status s = cuda::CudaUsable(); !s.ok()) GTEST_SKIP() << s.message();
  auto pair = MakePair(Variant::kUntied, DType::kF32);
  ASSERT_TRUE(pair.ok()) << pair.status().ToString();
  auto decoder = cuda::LlamaDecoder::Create(pair->gpu, 8);
  ASSERT_TRUE(decoder.ok()) << decoder.status().ToString();
  Values logits(97);
  const std::vector<int32_t> nine(9, 1), eight(8, 1);
  EXPECT_EQ(decoder->Append(nine, logits).message(), "cuda kv cache: 0 cached + 9 new positions exceed the capacity 8");
  EXPECT_EQ(decoder->Append(std::vector<int32_t>{1, 97}, logits).message(),
            "cuda kv cache: token id 97 at index 1 is outside the vocabulary [0, 97)");
  EXPECT_EQ(decoder->Append(std::vector<int32_t>{-1}, logits).message(),
            "cuda kv cache: token id -1 at index 0 is outside the vocabulary [0, 97)");
  Values short_logits(96);
  EXPECT_EQ(decoder->Append(std::vector<int32_t>{1}, short_logits).message(),
            "cuda kv cache: a logits span of 96 floats for a vocabulary of 97");
  EXPECT_EQ(decoder->Append({}, logits).message(), "cuda kv cache: no tokens to append");
  EXPECT_EQ(decoder->length(), 0);
  ASSERT_OK(decoder->Append(eight, logits));
  EXPECT_EQ(decoder->Append(std::vector<int32_t>{1}, logits).message(),
            "cuda kv cache: 8 cached + 1 new positions exceed the capacity 8");
  EXPECT_EQ(decoder->length(), 8);
  EXPECT_EQ(cuda::LlamaDecoder::Create(pair->gpu, 49).status().message(),
            "cuda kv cache: capacity 49 is outside [1, 48] (max_seq_len)");
  EXPECT_EQ(cuda::LlamaDecoder::Create(pair->gpu, -1).status().message(),
            "cuda kv cache: capacity -1 is outside [1, 48] (max_seq_len)");
  // Generate bounds the positions by the decoder's capacity.
  EXPECT_EQ(Generate(*decoder, kPrompt, {.max_new_tokens = 4}).status().message(),
            "generate: a prompt of 6 tokens and 4 new ones exceed the context of 8");
  EXPECT_TRUE(Generate(*decoder, kPrompt, {.max_new_tokens = 3}).ok());  // the last token is never fed back
}

// What the program reports is where it ran: the runtime's current device, by
// ordinal and name, and the engine's precision; the CPU decoder says cpu.
TEST(CudaGenerateDevice, TheDecoderReportsTheGpuItRunsOn) {
  if (Status s = cuda::CudaUsable(); !s.ok()) GTEST_SKIP() << s.message();
  int ordinal = -1;
  ASSERT_EQ(cudaGetDevice(&ordinal), cudaSuccess);
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, ordinal), cudaSuccess);
  for (const DType precision : {DType::kF32, DType::kBF16}) {
    auto pair = MakePair(Variant::kTied, precision);
    ASSERT_TRUE(pair.ok()) << pair.status().ToString();
    auto decoder = cuda::LlamaDecoder::Create(pair->gpu);
    ASSERT_TRUE(decoder.ok()) << decoder.status().ToString();
    EXPECT_EQ(decoder->device(), "cuda:" + std::to_string(ordinal) + " (" + prop.name + ") " +
                                     (precision == DType::kF32 ? "f32" : "bf16"));
    // Two caches of [3 layers, 2 kv heads, 48 positions, head_dim 8].
    EXPECT_EQ(decoder->cache_bytes(), size_t(2) * 3 * 2 * 48 * 8 * (precision == DType::kF32 ? 4 : 2));
    std::printf("decoder device: %s\n", decoder->device().c_str());
    auto cpu = KvCacheDecoder::Create(pair->cpu);
    ASSERT_TRUE(cpu.ok());
    EXPECT_EQ(cpu->device(), "cpu f32");
  }
}

}  // namespace
}  // namespace estuary::models
