// Generation (models/generate.h, models/sampling.h): the cached decoder
// against the model's own full forward at every step, sampling's filtered
// distributions against Hugging Face's warpers in PyTorch (torch_sampling.py,
// the models_torch_sampling fixture), draw frequencies against those
// distributions, and `estuary-lm generate` against the library call.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>

#include "tests/e2e/harness.h"
#include "models/generate.h"
#include "models/lora.h"
#include "models/tokenizer.h"

namespace estuary::models {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// max|a - b| / max|b|: the error metric of the decoder's tests (llama_fixture.h).
double RelativeError(std::span<const float> a, std::span<const float> b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - b[i]));
    scale = std::max(scale, std::abs(double(b[i])));
  }
  return diff / scale;
}

// The decoders CachedDecode runs: untied, tied, and one with what published
// configs add (q/k/v, o and MLP biases, a head_dim other than hidden / heads,
// llama3 RoPE scaling that rescales part of the frequencies).
enum class Variant { kUntied, kTied, kPublished };

// A small decoder with grouped-query attention (4 query heads on 2 kv heads)
// whose weights are scaled up from the init (x3), so that activations, and
// with them any disagreement, are not hidden by the init's tiny scale. The
// rounding of differently shaped GEMMs grows with the scale: here it stays
// below 1.7e-6 of the largest logit (x8 takes it past 1e-5).

Llama SmallModel(Variant variant, int vocab = 97, uint64_t seed = 3) {
  LlamaConfig c{.vocab_size = vocab, .hidden_size = 32, .intermediate_size = 48, .num_layers = 3, .num_heads = 4,
                .num_kv_heads = 2, .max_seq_len = 48, .tie_embeddings = variant == Variant::kTied};
  if (variant == Variant::kPublished) {
    c.qkv_bias = c.o_bias = c.mlp_bias = true;
    c.explicit_head_dim = 12;
    c.rope_scaling = {.kind = RopeScaling::Kind::kLlama3, .factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
                      .original_max_position_embeddings = 32};
  }
  auto model = Llama::Create(c, 1);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  model->Initialize(seed);
  for (float& p : model->parameters()) p *= 3;
  // The init makes every bias one; draw them instead, so each is its own.
  std::mt19937_64 rng(seed);
  for (const TensorSpec& t : model->manifest().tensors) {
    if (!t.name.ends_with(".bias")) continue;
    for (uint64_t i = 0; i < t.numel(); ++i) {
      model->parameters()[t.offset + i] = float(0.2 * (double(rng() >> 11) * 0x1.0p-53 - 0.5));
    }
  }
  return std::move(*model);
}

// The last row of Forward over `tokens`: the logits that follow them.
std::vector<float> FullForwardNext(Llama& model, const std::vector<int32_t>& tokens) {
  const int V = model.config().vocab_size, seq = int(tokens.size());
  std::vector<float> logits(size_t(seq) * V);
  EXPECT_TRUE(model.Forward(tokens.data(), 1, seq, logits.data()).ok());
  return {logits.end() - V, logits.end()};
}

constexpr double kDecodeTolerance = 1e-5;
const std::vector<int32_t> kPrompt = {5, 17, 42, 8, 91, 3};

class CachedDecode : public ::testing::TestWithParam<Variant> {};
INSTANTIATE_TEST_SUITE_P(Decoders, CachedDecode,
                         ::testing::Values(Variant::kUntied, Variant::kTied, Variant::kPublished),
                         [](const auto& info) {
                           return info.param == Variant::kUntied ? "Untied"
                                  : info.param == Variant::kTied ? "Tied"
                                                                 : "BiasesHeadDimRopeScaling";
                         });

// Prefill, then 30 sampled tokens one at a time: every step's logits are
// the full forward's over the sequence so far.
TEST_P(CachedDecode, EveryStepGivesTheFullForwardsLogits) {
  Llama model = SmallModel(GetParam());
  auto decoder = KvCacheDecoder::Create(model);
  ASSERT_TRUE(decoder.ok()) << decoder.status().ToString();
  std::vector<int32_t> sequence = kPrompt;
  std::vector<float> logits(model.config().vocab_size);
  ASSERT_TRUE(decoder->Append(sequence, logits).ok());
  TokenSampler sampler({.temperature = 1.0, .seed = 11});
  for (int step = 0; step <= 30; ++step) {
    if (step > 0) {
      ASSERT_TRUE(decoder->Append(std::span(&sequence.back(), 1), logits).ok());
    }
    ASSERT_EQ(decoder->length(), int(sequence.size()));
    const std::vector<float> expected = FullForwardNext(model, sequence);
    EXPECT_LE(RelativeError(logits, expected), kDecodeTolerance) << "step " << step;
    sequence.push_back(sampler.Next(logits));
  }
}

// Several tokens appended at once continue a cached sequence as well as one does.
TEST_P(CachedDecode, AChunkAfterThePromptContinuesTheCache) {
  Llama model = SmallModel(GetParam());
  auto decoder = KvCacheDecoder::Create(model);
  ASSERT_TRUE(decoder.ok());
  std::vector<float> logits(model.config().vocab_size);
  ASSERT_TRUE(decoder->Append(kPrompt, logits).ok());
  const std::vector<int32_t> chunk = {60, 2, 33, 33, 70};
  ASSERT_TRUE(decoder->Append(chunk, logits).ok());
  std::vector<int32_t> sequence = kPrompt;
  sequence.insert(sequence.end(), chunk.begin(), chunk.end());
  EXPECT_LE(RelativeError(logits, FullForwardNext(model, sequence)), kDecodeTolerance);
  // Cleared, it starts over at position 0.
  decoder->Clear();
  ASSERT_TRUE(decoder->Append(chunk, logits).ok());
  EXPECT_LE(RelativeError(logits, FullForwardNext(model, chunk)), kDecodeTolerance);
}

TEST_P(CachedDecode, GreedyIsTheFullForwardsArgmaxAtEveryStep) {
  Llama model = SmallModel(GetParam());
  auto out = Generate(model, kPrompt, {.max_new_tokens = 30, .sampling = {.temperature = 0}});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_EQ(out->tokens.size(), 30u);
  EXPECT_FALSE(out->stopped);
  std::vector<int32_t> sequence = kPrompt;
  for (size_t i = 0; i < out->tokens.size(); ++i) {
    const std::vector<float> expected = FullForwardNext(model, sequence);
    EXPECT_EQ(out->tokens[i], Argmax(expected)) << "step " << i;
    EXPECT_NEAR(out->log_probs[i], LogSoftmaxAt(expected, out->tokens[i]), 1e-4);
    sequence.push_back(out->tokens[i]);
  }
  // A greedy run on a random model that repeats one token would prove little.
  EXPECT_GT(std::set<int32_t>(out->tokens.begin(), out->tokens.end()).size(), 3u);
}

TEST_P(CachedDecode, TopKOfOneIsGreedy) {
  Llama model = SmallModel(GetParam());
  auto greedy = Generate(model, kPrompt, {.max_new_tokens = 20, .sampling = {.temperature = 0}});
  auto top1 = Generate(model, kPrompt, {.max_new_tokens = 20, .sampling = {.temperature = 1.5, .top_k = 1, .seed = 9}});
  ASSERT_TRUE(greedy.ok() && top1.ok());
  EXPECT_EQ(top1->tokens, greedy->tokens);
}

TEST_P(CachedDecode, TheSameSeedGivesTheSameTokens) {
  Llama model = SmallModel(GetParam());
  const SamplingOptions sampling{.temperature = 1.0, .top_p = 0.95, .seed = 1234};
  auto first = Generate(model, kPrompt, {.max_new_tokens = 25, .sampling = sampling});
  auto again = Generate(model, kPrompt, {.max_new_tokens = 25, .sampling = sampling});
  SamplingOptions other = sampling;
  other.seed = 1235;
  auto reseeded = Generate(model, kPrompt, {.max_new_tokens = 25, .sampling = other});
  ASSERT_TRUE(first.ok() && again.ok() && reseeded.ok());
  EXPECT_EQ(first->tokens, again->tokens);
  EXPECT_NE(first->tokens, reseeded->tokens);
}

TEST_P(CachedDecode, AStopTokenEndsGeneration) {
  Llama model = SmallModel(GetParam());
  auto free_run = Generate(model, kPrompt, {.max_new_tokens = 30, .sampling = {.temperature = 0}});
  ASSERT_TRUE(free_run.ok());
  // Stop on the fifth token: generation ends at its first occurrence, which it includes.
  const int32_t stop = free_run->tokens[4];
  const size_t first = std::find(free_run->tokens.begin(), free_run->tokens.end(), stop) - free_run->tokens.begin();
  auto stopped =
      Generate(model, kPrompt, {.max_new_tokens = 30, .sampling = {.temperature = 0}, .stop_tokens = {1000, stop}});
  ASSERT_TRUE(stopped.ok());
  EXPECT_TRUE(stopped->stopped);
  EXPECT_EQ(stopped->tokens, std::vector<int32_t>(free_run->tokens.begin(), free_run->tokens.begin() + first + 1));
  auto capped = Generate(model, kPrompt, {.max_new_tokens = 3, .sampling = {.temperature = 0}});
  ASSERT_TRUE(capped.ok());
  EXPECT_EQ(capped->tokens, std::vector<int32_t>(free_run->tokens.begin(), free_run->tokens.begin() + 3));
}

// The adapted model's generation: the merged model, decoded with the cache,
// gives LoraLlama's own forward at every step.
TEST_P(CachedDecode, AnAdaptedModelDecodesAsItsOwnForward) {
  auto lora = LoraLlama::Create(SmallModel(GetParam()),
                                {.rank = 4, .alpha = 8, .target_modules = {"q_proj", "v_proj", "o_proj", "down_proj"}});
  ASSERT_TRUE(lora.ok()) << lora.status().ToString();
  // Non-zero A and B, so the adapters change the logits.
  std::mt19937_64 rng(5);
  for (float& p : lora->parameters()) p = float(0.1 * (double(rng() >> 11) * 0x1.0p-53 - 0.5));
  auto merged = lora->Merged();
  ASSERT_TRUE(merged.ok());
  auto decoder = KvCacheDecoder::Create(*merged);
  ASSERT_TRUE(decoder.ok());
  const int V = merged->config().vocab_size;
  std::vector<int32_t> sequence = kPrompt;
  std::vector<float> logits(V), all;
  ASSERT_TRUE(decoder->Append(sequence, logits).ok());
  for (int step = 0; step <= 20; ++step) {
    if (step > 0) {
      ASSERT_TRUE(decoder->Append(std::span(&sequence.back(), 1), logits).ok());
    }
    all.resize(sequence.size() * V);
    ASSERT_TRUE(lora->Forward(sequence.data(), 1, int(sequence.size()), all.data()).ok());
    const std::vector<float> adapted(all.end() - V, all.end());
    EXPECT_LE(RelativeError(logits, adapted), kDecodeTolerance) << "step " << step;
    EXPECT_GT(RelativeError(logits, FullForwardNext(lora->base(), sequence)), 1e-2) << "the adapters did nothing";
    sequence.push_back(Argmax(logits));
  }
}

TEST(CachedDecodeErrors, BadInputIsRefusedInOneLine) {
  Llama model = SmallModel(Variant::kUntied);
  auto decoder = KvCacheDecoder::Create(model, 8);
  ASSERT_TRUE(decoder.ok());
  std::vector<float> logits(97);
  const std::vector<int32_t> nine(9, 1);
  EXPECT_EQ(decoder->Append(nine, logits).message(), "kv cache: 0 cached + 9 new positions exceed the capacity 8");
  EXPECT_EQ(decoder->Append(std::vector<int32_t>{1, 97}, logits).message(),
            "kv cache: token id 97 at index 1 is outside the vocabulary [0, 97)");
  EXPECT_EQ(decoder->length(), 0);
  EXPECT_EQ(KvCacheDecoder::Create(model, 49).status().message(),
            "kv cache: capacity 49 is outside [1, 48] (max_seq_len)");
  EXPECT_EQ(Generate(model, kPrompt, {.max_new_tokens = 44}).status().message(),
            "generate: a prompt of 6 tokens and 44 new ones exceed the context of 48");
  EXPECT_TRUE(Generate(model, kPrompt, {.max_new_tokens = 43}).ok());  // the last token is never fed back
  EXPECT_EQ(Generate(model, kPrompt, {.sampling = {.top_p = 0}}).status().message(),
            "sampling: top_p 0 must be in (0, 1]");
  EXPECT_EQ(Generate(model, {}, {}).status().message(), "generate: the prompt holds no tokens");
  EXPECT_EQ(Generate(model, std::vector<int32_t>{1, 97}, {.max_new_tokens = 0}).status().message(),
            "kv cache: token id 97 at index 1 is outside the vocabulary [0, 97)");
}

// ------------------------------------------------------------------ sampling

Json SamplingReference() {
  const fs::path path = fs::path(ESTUARY_BINARY_DIR) / "tests/models/sampling/sampling.json";
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path << " is missing: run the models_torch_sampling fixture";
  return Json::parse(in);
}

std::vector<float> ReferenceLogits(const Json& reference, const Json& c) {
  return reference["logits"][c["logits"].get<std::string>()].get<std::vector<float>>();
}

SamplingOptions OptionsOf(const Json& c) {
  return {.temperature = c["temperature"], .top_k = c["top_k"], .top_p = c["top_p"]};
}

TEST(Sampling, FilteredDistributionsAreHuggingFacesWarpers) {
  const Json reference = SamplingReference();
  ASSERT_FALSE(reference["cases"].empty());
  for (const Json& c : reference["cases"]) {
    const std::vector<double> expected = c["probs"];
    const std::vector<double> probs = SamplingDistribution(ReferenceLogits(reference, c), OptionsOf(c));
    ASSERT_EQ(probs.size(), expected.size());
    const std::string where = c.dump().substr(0, 80);
    for (size_t i = 0; i < probs.size(); ++i) {
      EXPECT_EQ(probs[i] == 0, expected[i] == 0) << where << ": token " << i << " kept by one side only";
      EXPECT_NEAR(probs[i], expected[i], 1e-12) << where << ": token " << i;
    }
  }
}

// Pearson's chi-square of `counts` against `probs` over the tokens probs keeps.
double ChiSquare(const std::vector<int64_t>& counts, const std::vector<double>& probs, int64_t draws) {
  double chi2 = 0;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] == 0) continue;
    const double expected = probs[i] * double(draws);
    chi2 += (double(counts[i]) - expected) * (double(counts[i]) - expected) / expected;
  }
  return chi2;
}

// The chi-square quantile that a correct sampler exceeds with probability
// about 1e-6 (Wilson-Hilferty's approximation, z = 4.753).
double ChiSquareBound(int degrees_of_freedom) {
  const double k = degrees_of_freedom, z = 4.753;
  return k * std::pow(1 - 2 / (9 * k) + z * std::sqrt(2 / (9 * k)), 3);
}

TEST(Sampling, DrawFrequenciesMatchTheDistribution) {
  const Json reference = SamplingReference();
  constexpr int64_t kDraws = 200000;
  int checked = 0;
  for (const Json& c : reference["cases"]) {
    const std::vector<double> expected = c["probs"];
    const int kept = int(std::count_if(expected.begin(), expected.end(), [](double p) { return p > 0; }));
    if (kept < 3) continue;
    const std::vector<float> logits = ReferenceLogits(reference, c);
    SamplingOptions options = OptionsOf(c);
    options.seed = 77;
    TokenSampler sampler(options);
    std::vector<int64_t> counts(expected.size());
    for (int64_t d = 0; d < kDraws; ++d) ++counts[sampler.Next(logits)];
    const std::string where = c.dump().substr(0, 80);
    for (size_t i = 0; i < expected.size(); ++i) {
      if (expected[i] == 0) {
        EXPECT_EQ(counts[i], 0) << where << ": filtered token " << i << " drawn";
      }
    }
    const double bound = ChiSquareBound(kept - 1);
    EXPECT_LT(ChiSquare(counts, expected, kDraws), bound) << where;
    // The test has the power to see a sampler that ignored the temperature
    // or the filters: the unfiltered softmax fails the same bound.
    SamplingOptions plain;
    const std::vector<double> unfiltered = SamplingDistribution(logits, plain);
    if (options.temperature != 1 || kept < int(expected.size())) {
      EXPECT_GT(ChiSquare(counts, unfiltered, kDraws), ChiSquareBound(int(expected.size()) - 1)) << where;
    }
    ++checked;
  }
  EXPECT_GE(checked, 6);
}

// ---------------------------------------------------------------- the tool

using estuary::testing::CommandResult;
using estuary::testing::RunCommand;

const std::string kLm = std::string(ESTUARY_BINARY_DIR) + "/models/estuary-lm";
const fs::path kLlama2 = fs::path(ESTUARY_BINARY_DIR) / "tests/models/tokenizer/tokenizers/llama2/tokenizer.json";

class GenerateCommand : public ::testing::Test {
 protected:
  void SetUp() override {
    auto tokenizer = Tokenizer::Load(kLlama2);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
    tokenizer_.emplace(*tokenizer);
    // A random model over the fixture tokenizer's vocabulary.
    LlamaConfig c{.vocab_size = tokenizer_->vocab_size(), .hidden_size = 32, .intermediate_size = 48,
                  .num_layers = 2, .num_heads = 4, .num_kv_heads = 2, .max_seq_len = 64, .tie_embeddings = true};
    auto model = Llama::Create(c, 1);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    model->Initialize(21);
    for (float& p : model->parameters()) p *= 3;
    dir_ = fs::temp_directory_path() / fmt::format("estuary-generate-test-{}", getpid());
    ASSERT_TRUE(SaveHfCheckpoint(dir_ / "model", *model).ok());
    model_.emplace(std::move(*model));
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Command(const std::string& flags) const {
    return fmt::format("{} generate --model {} --tokenizer {} --prompt 'Hello world' {}", kLm,
                       (dir_ / "model").string(), kLlama2.string(), flags);
  }

  std::optional<Tokenizer> tokenizer_;
  std::optional<Llama> model_;
  fs::path dir_;
};

TEST_F(GenerateCommand, GreedyOutputIsTheLibrarys) {
  CommandResult run = RunCommand(Command("--temperature 0 --max-new-tokens 12 --json"));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const Json out = Json::parse(run.output);
  const std::vector<int32_t> prompt = tokenizer_->Encode("Hello world", /*add_special_tokens=*/true);
  EXPECT_EQ(out["prompt_ids"].get<std::vector<int32_t>>(), prompt);
  const GenerateOptions greedy{
      .max_new_tokens = 12, .sampling = {.temperature = 0}, .stop_tokens = {*tokenizer_->eos_id()}};
  auto expected = Generate(*model_, prompt, greedy);
  ASSERT_TRUE(expected.ok());
  EXPECT_EQ(out["ids"].get<std::vector<int32_t>>(), expected->tokens);
  const std::vector<double> log_probs = out["log_probs"];
  ASSERT_EQ(log_probs.size(), expected->log_probs.size());
  for (size_t i = 0; i < log_probs.size(); ++i) EXPECT_NEAR(log_probs[i], expected->log_probs[i], 1e-9);
  EXPECT_EQ(out["text"], tokenizer_->Decode(expected->tokens, /*skip_special_tokens=*/true));
  // Without --json: the text alone.
  run = RunCommand(Command("--temperature 0 --max-new-tokens 12"));
  EXPECT_EQ(run.output, out["text"].get<std::string>() + "\n");
}

TEST_F(GenerateCommand, AnAdapterIsMergedIn) {
  auto base = LoadHfCheckpoint(dir_ / "model");
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  auto adapted = LoraLlama::Create(std::move(*base), {.rank = 2, .alpha = 4});
  ASSERT_TRUE(adapted.ok());
  std::mt19937_64 rng(8);
  for (float& p : adapted->parameters()) p = float(0.2 * (double(rng() >> 11) * 0x1.0p-53 - 0.5));
  ASSERT_TRUE(SaveLoraAdapter(dir_ / "adapter", *adapted).ok());
  CommandResult run = RunCommand(Command(fmt::format("--adapter {} --temperature 0 --max-new-tokens 12 --json",
                                              (dir_ / "adapter").string())));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  auto merged = adapted->Merged();
  ASSERT_TRUE(merged.ok());
  const std::vector<int32_t> prompt = tokenizer_->Encode("Hello world", /*add_special_tokens=*/true);
  const GenerateOptions greedy{
      .max_new_tokens = 12, .sampling = {.temperature = 0}, .stop_tokens = {*tokenizer_->eos_id()}};
  auto expected = Generate(*merged, prompt, greedy), plain = Generate(*model_, prompt, greedy);
  ASSERT_TRUE(expected.ok() && plain.ok());
  EXPECT_EQ(Json::parse(run.output)["ids"].get<std::vector<int32_t>>(), expected->tokens);
  EXPECT_NE(expected->tokens, plain->tokens) << "the adapter changed nothing";
}

TEST_F(GenerateCommand, TheSeedDecidesTheSample) {
  const std::string flags = "--top-k 50 --top-p 0.9 --temperature 1.2 --max-new-tokens 16 --json --seed ";
  const CommandResult first = RunCommand(Command(flags + "7")), again = RunCommand(Command(flags + "7")),
                 other = RunCommand(Command(flags + "8"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_EQ(first.output, again.output);
  EXPECT_NE(Json::parse(first.output)["ids"], Json::parse(other.output)["ids"]);
}

// --device cuda runs the GPU decoder (models/cuda/llama_decoder.h), which
// says so in the JSON, and under fp32 picks the CPU's greedy tokens. Skips
// where this build or machine cannot run CUDA, as the tool reports it.
TEST_F(GenerateCommand, OnCudaTheGreedyOutputIsTheCpus) {
  const CommandResult run = RunCommand(Command("--device cuda --temperature 0 --max-new-tokens 12 --json"));
  if (run.exit_code != 0 && run.output.starts_with("estuary-lm: --device cuda: ")) GTEST_SKIP() << run.output;
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const Json out = Json::parse(run.output);
  EXPECT_TRUE(out["device"].get<std::string>().starts_with("cuda:")) << out["device"];
  EXPECT_TRUE(out["device"].get<std::string>().ends_with(" f32")) << out["device"];
  const CommandResult cpu = RunCommand(Command("--temperature 0 --max-new-tokens 12 --json"));
  ASSERT_EQ(cpu.exit_code, 0) << cpu.output;
  const Json expected = Json::parse(cpu.output);
  EXPECT_EQ(expected["device"], "cpu f32");
  EXPECT_EQ(out["ids"], expected["ids"]);
  const std::vector<double> log_probs = out["log_probs"], cpu_log_probs = expected["log_probs"];
  ASSERT_EQ(log_probs.size(), cpu_log_probs.size());
  for (size_t i = 0; i < log_probs.size(); ++i) EXPECT_NEAR(log_probs[i], cpu_log_probs[i], 1e-4);
  const CommandResult bf16 =
      RunCommand(Command("--device cuda --precision bf16 --temperature 0 --max-new-tokens 12 --json"));
  ASSERT_EQ(bf16.exit_code, 0) << bf16.output;
  EXPECT_TRUE(Json::parse(bf16.output)["device"].get<std::string>().ends_with(" bf16")) << bf16.output;
}

TEST_F(GenerateCommand, BadInputIsOneLine) {
  CommandResult run = RunCommand(Command("--top-p 1.5"));
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_EQ(run.output, "estuary-lm: sampling: top_p 1.5 must be in (0, 1]\n");
  run = RunCommand(fmt::format("{} generate --model {} --tokenizer {} --prompt hi", kLm, (dir_ / "missing").string(),
                             kLlama2.string()));
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_EQ(std::count(run.output.begin(), run.output.end(), '\n'), 1) << run.output;
  EXPECT_NE(run.output.find((dir_ / "missing").string()), std::string::npos) << run.output;
  run = RunCommand(Command("--max-new-tokens 100"));
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_EQ(run.output, "estuary-lm: generate: a prompt of 3 tokens and 100 new ones exceed the context of 64\n");
  run = RunCommand(Command("--precision bf16"));
  EXPECT_EQ(run.output, "estuary-lm: --precision bf16 needs --device cuda: the CPU decoder runs in fp32\n");
  run = RunCommand(Command("--device tpu"));
  EXPECT_EQ(run.output, "estuary-lm: --device 'tpu': expected cpu, cuda or cuda:N\n");
  run = RunCommand(Command("--device cuda --precision fp8"));
  EXPECT_EQ(run.output, "estuary-lm: --precision 'fp8': expected fp32, bf16 or fp16\n");
}

}  // namespace
}  // namespace estuary::models
