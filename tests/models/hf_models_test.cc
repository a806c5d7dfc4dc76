// Published models' configurations (SmolLM-135M, TinyLlama-1.1B, Llama-3.2-1B,
// Qwen2-0.5B, cut to two layers) loaded by LoadHfCheckpoint against the torch
// oracle: logits, loss and every gradient, full and LoRA; the same weights
// stored in bf16, f16 and in shards; and the one-line errors of the loader.
// torch_llama.py writes the references (the models_torch_llama ctest fixture).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/checkpoint.h"
#include "models/llama.h"
#include "models/lora.h"
#include "tests/e2e/harness.h"
#include "tests/models/llama_fixture.h"

namespace estuary::models {
namespace {

using namespace fixture;
namespace fs = std::filesystem;

constexpr double kModelTolerance = 1e-4;
constexpr int kContext = 32;  // the context every real model runs at here, whatever the config claims

Checkpoint Expected(const std::string& file) {
  auto loaded = LoadCheckpoint(kReference / file);
  EXPECT_TRUE(loaded.ok()) << loaded.status().ToString();
  return loaded.ok() ? std::move(loaded).value() : Checkpoint{};
}

// One tensor of a reference file.
Values Tensor(const Checkpoint& c, const std::string& name) {
  const TensorSpec* t = c.manifest.Find(name);
  EXPECT_NE(t, nullptr) << name;
  if (!t) return {};
  return Values(c.data.begin() + t->offset, c.data.begin() + t->offset + t->numel());
}

Result<Llama> LoadReal(const std::string& dir, int max_batch) {
  return LoadHfCheckpoint(kReference / dir, HfLoadOptions{.max_batch = max_batch, .max_seq_len = kContext});
}

bool SameBits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

class RealConfig : public ::testing::TestWithParam<const char*> {
 protected:
  std::string name() const { return GetParam(); }
  nlohmann::json f = Fixture(std::string("real_") + GetParam());
  int batch = f["batch"], seq = f["seq"];
  Ids tokens = GetIds(f, "tokens"), targets = GetIds(f, "targets");
};

TEST_P(RealConfig, RopeFrequenciesAreTransformers) {
  auto config = ReadHfConfig(kReference / ("real_" + name()), kContext);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  const std::vector<double> ours = config->RopeInverseFrequencies();
  const std::vector<double> torch = f["inv_freq"].get<std::vector<double>>();
  ASSERT_EQ(ours.size(), torch.size());
  for (size_t j = 0; j < ours.size(); ++j) EXPECT_NEAR(ours[j] / torch[j], 1.0, 1e-12) << "j " << j;
}

TEST_P(RealConfig, LogitsLossAndEveryGradientMatchTorch) {
  auto model = LoadReal("real_" + name(), batch);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  EXPECT_EQ(model->config().architecture, f["architecture"].get<std::string>());
  // Hugging Face's state_dict names, in its order (the tied lm_head left out).
  const auto names = f["names"].get<std::vector<std::string>>();
  ASSERT_EQ(model->manifest().tensors.size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) EXPECT_EQ(model->manifest().tensors[i].name, names[i]);
  const Checkpoint expected = Expected("real_" + name() + "_expected.safetensors");

  Values logits(size_t(batch) * seq * model->config().vocab_size);
  ASSERT_TRUE(model->Forward(tokens.data(), batch, seq, logits.data()).ok());
  EXPECT_LE(RelativeError(logits.data(), Tensor(expected, "logits")), kModelTolerance);
  auto loss = model->ForwardBackward(tokens.data(), targets.data(), batch, seq);
  ASSERT_TRUE(loss.ok()) << loss.status().ToString();
  EXPECT_LE(RelativeError(&*loss, Get(f, "loss")), kModelTolerance);
  double worst = 0;
  for (const TensorSpec& t : model->manifest().tensors) {
    const double error = RelativeError(model->gradients().data() + t.offset, Tensor(expected, t.name + ".grad"));
    EXPECT_LE(error, kModelTolerance) << t.name;
    worst = std::max(worst, error);
  }
  RecordProperty("worst_gradient_error", fmt::format("{:.2e}", worst));  // the figure docs/ quotes
}

TEST_P(RealConfig, LoraLogitsLossAndEveryAdapterGradientMatchTorch) {
  auto base = LoadReal("real_" + name(), batch);
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  LoraConfig lora;
  lora.rank = f["lora"]["r"];
  lora.alpha = f["lora"]["lora_alpha"];
  lora.target_modules = f["lora"]["target_modules"].get<std::vector<std::string>>();
  auto model = LoraLlama::Create(std::move(base).value(), lora);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const Checkpoint expected = Expected("real_" + name() + "_expected.safetensors");
  for (const TensorSpec& t : model->manifest().tensors) {
    const Values v = Tensor(expected, "lora:" + t.name);
    ASSERT_EQ(v.size(), t.numel()) << t.name;
    std::copy(v.begin(), v.end(), model->parameters().begin() + t.offset);
  }
  Values logits(size_t(batch) * seq * model->base().config().vocab_size);
  ASSERT_TRUE(model->Forward(tokens.data(), batch, seq, logits.data()).ok());
  EXPECT_LE(RelativeError(logits.data(), Tensor(expected, "lora_logits")), kModelTolerance);
  auto loss = model->ForwardBackward(tokens.data(), targets.data(), batch, seq);
  ASSERT_TRUE(loss.ok()) << loss.status().ToString();
  EXPECT_LE(RelativeError(&*loss, Get(f, "lora_loss")), kModelTolerance);
  double worst = 0;
  for (const TensorSpec& t : model->manifest().tensors) {
    const double error =
        RelativeError(model->gradients().data() + t.offset, Tensor(expected, "lora:" + t.name + ".grad"));
    EXPECT_LE(error, kModelTolerance) << t.name;
    worst = std::max(worst, error);
  }
  RecordProperty("worst_gradient_error", fmt::format("{:.2e}", worst));
}

// What SaveHfCheckpoint writes (config keys of the architecture, biases,
// head_dim, rope_scaling) loads back bit for bit, and the torch oracle loads
// it as from_pretrained would and computes the same logits.
TEST_P(RealConfig, SavedDirectoryReloadsAndTorchLoadsIt) {
  auto model = LoadReal("real_" + name(), batch);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  testing::TempDir dir;
  ASSERT_TRUE(SaveHfCheckpoint(dir.path(), *model).ok());
  auto again = LoadHfCheckpoint(dir.path(), HfLoadOptions{.max_batch = batch, .max_seq_len = kContext});
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(SameBits(again->parameters(), model->parameters()));
  EXPECT_EQ(again->config().max_position_embeddings, model->config().max_position_embeddings);
  EXPECT_EQ(again->config().architecture, model->config().architecture);

  nlohmann::json request = {{"tokens", nlohmann::json::array()}};
  for (int b = 0; b < batch; ++b) {
    request["tokens"].push_back(Ids(tokens.begin() + b * seq, tokens.begin() + (b + 1) * seq));
  }
  std::ofstream(dir / "tokens.json") << request.dump();
  auto run = testing::RunCommand(TorchPython() + " " + ESTUARY_SOURCE_DIR + "/tests/models/torch_llama.py --check-hf " +
                                 dir.path().string());
  ASSERT_EQ(run.exit_code, 0) << run.output;
  std::ifstream in(dir / "logits.json");
  const Values torch_logits = nlohmann::json::parse(in)["logits"].get<Values>();
  Values logits(size_t(batch) * seq * model->config().vocab_size);
  ASSERT_TRUE(model->Forward(tokens.data(), batch, seq, logits.data()).ok());
  ASSERT_EQ(torch_logits.size(), logits.size());
  EXPECT_LE(RelativeError(logits.data(), torch_logits), kModelTolerance);
}

// The GPU engine (models/cuda/) refuses what it does not implement, naming it.
TEST_P(RealConfig, TheGpuEngineNamesWhatItLacks) {
  auto config = ReadHfConfig(kReference / ("real_" + name()), kContext);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  const std::string lacks = GpuEngineLacks(*config);
  if (name() == "qwen2_05b") {
    EXPECT_EQ(lacks, "attention biases (attention_bias, or Qwen2's q/k/v biases)");
  } else {
    EXPECT_EQ(lacks, "");
  }
  config->explicit_head_dim = 2 * config->head_dim();
  config->qkv_bias = config->o_bias = false;
  EXPECT_NE(GpuEngineLacks(*config).find("a head_dim of"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Published, RealConfig,
                         ::testing::Values("smollm_135m", "tinyllama_1b", "llama32_1b", "qwen2_05b"));

// ------------------------------------------------------------ storage forms

// torch rounded the weights to bf16 and to f16 (tensor.to(...)) and saved
// them; each loads to exactly what torch makes of them in fp32.
TEST(HfCheckpointDtypes, HalfPrecisionWeightsLoadToTorchsFp32Values) {
  for (const char* dtype : {"bf16", "f16"}) {
    auto model = LoadReal(std::string("real_smollm_135m_") + dtype, 1);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    const Checkpoint expected = Expected(std::string("real_smollm_135m_") + dtype + "_as_f32.safetensors");
    for (const TensorSpec& t : model->manifest().tensors) {
      const Values want = Tensor(expected, t.name);
      EXPECT_TRUE(SameBits(model->parameters().subspan(t.offset, t.numel()), want)) << dtype << " " << t.name;
    }
  }
}

TEST(HfCheckpointDtypes, ShardedDirectoryLoadsAsTheSingleFile) {
  auto single = LoadReal("real_smollm_135m", 1);
  auto sharded = LoadReal("real_smollm_135m_sharded", 1);
  ASSERT_TRUE(single.ok()) << single.status().ToString();
  ASSERT_TRUE(sharded.ok()) << sharded.status().ToString();
  EXPECT_TRUE(SameBits(single->parameters(), sharded->parameters()));
}

// Every one of the 65536 bit patterns, against torch's widening (a NaN
// against a NaN: the payload is not compared).
TEST(HfCheckpointDtypes, EveryHalfBitPatternWidensAsTorchDoes) {
  const Checkpoint expected = Expected("halves.safetensors");
  for (const char* dtype : {"f16", "bf16"}) {
    const fs::path file = kReference / (std::string("halves.safetensors.") + dtype);
    EXPECT_FALSE(LoadCheckpoint(file).ok()) << "F32 only unless asked";
    auto loaded = LoadCheckpoint(file, {.widen_half = true});
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    EXPECT_EQ(loaded->stored.at(dtype), std::string(dtype) == "f16" ? DType::kF16 : DType::kBF16);
    const Values want = Tensor(expected, std::string(dtype) + "_as_f32");
    ASSERT_EQ(loaded->data.size(), 65536u);
    int mismatches = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const float got = loaded->data[i];
      const bool same = std::isnan(want[i]) ? std::isnan(got) : std::memcmp(&got, &want[i], 4) == 0;
      if (!same && ++mismatches < 5) {
        ADD_FAILURE() << dtype << " bits 0x" << std::hex << i << ": " << got << " vs " << want[i];
      }
    }
    EXPECT_EQ(mismatches, 0) << dtype;
  }
}

// ------------------------------------------------------------------ errors

void WriteJson(const fs::path& path, const nlohmann::json& json) { std::ofstream(path) << json.dump(2); }
nlohmann::json ReadJson(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// A copy of a reference directory to edit.
fs::path CopyOf(const std::string& name, const testing::TempDir& dir) {
  const fs::path to = dir / name;
  fs::copy(kReference / name, to, fs::copy_options::recursive);
  return to;
}

std::string LoadError(const fs::path& dir, HfLoadOptions options = {.max_batch = 1, .max_seq_len = kContext}) {
  auto loaded = LoadHfCheckpoint(dir, options);
  EXPECT_FALSE(loaded.ok()) << dir;
  if (loaded.ok()) return "";
  const std::string& message = loaded.status().message();
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  return message;
}

TEST(HfCheckpointShards, EveryTensorInExactlyTheShardTheIndexNames) {
  testing::TempDir tmp;
  const fs::path dir = CopyOf("real_smollm_135m_sharded", tmp);
  const fs::path index_path = dir / "model.safetensors.index.json";
  const nlohmann::json index = ReadJson(index_path);
  const std::string first = "model-00001-of-00003.safetensors", third = "model-00003-of-00003.safetensors";

  nlohmann::json edited = index;
  edited["weight_map"].erase("model.norm.weight");
  WriteJson(index_path, edited);
  EXPECT_EQ(LoadError(dir), index_path.string() + ": tensor 'model.norm.weight' is missing from weight_map");

  // A tensor that shard 1 holds, said to be in shard 3.
  const std::string moved = "model.embed_tokens.weight";
  ASSERT_EQ(index["weight_map"][moved], first);
  edited = index;
  edited["weight_map"][moved] = third;
  WriteJson(index_path, edited);
  EXPECT_EQ(LoadError(dir), (dir / first).string() + ": tensor '" + moved + "' is here, but weight_map names " + third);

  // The same tensor in shards 1 and 3.
  WriteJson(index_path, index);
  auto shard1 = LoadCheckpoint(dir / first);
  auto shard3 = LoadCheckpoint(dir / third);
  ASSERT_TRUE(shard1.ok() && shard3.ok());
  Manifest both = shard3->manifest;
  std::vector<float> data = shard3->data;
  const TensorSpec* embed = shard1->manifest.Find(moved);
  both.Append(moved, embed->shape);
  data.insert(data.end(), shard1->data.begin() + embed->offset, shard1->data.begin() + embed->offset + embed->numel());
  ASSERT_TRUE(SaveCheckpoint(dir / third, both, data, {{"format", "pt"}}).ok());
  EXPECT_EQ(LoadError(dir), (dir / third).string() + ": tensor '" + moved + "' is also in " + first);

  fs::remove(dir / third);
  EXPECT_NE(LoadError(dir).find((dir / third).string() + ": cannot open checkpoint"), std::string::npos);
}

TEST(HfCheckpointLimits, AModelTooLargeIsRefusedWithTheArithmetic) {
  auto config = ReadHfConfig(kReference / "real_smollm_135m", kContext);
  ASSERT_TRUE(config.ok());
  const double parameters = config->ParameterCount();
  const uint64_t just_short = uint64_t(8 * parameters) - 1;
  const std::string error =
      LoadError(kReference / "real_smollm_135m", {.max_batch = 1, .max_seq_len = kContext, .max_bytes = just_short});
  EXPECT_NE(error.find(fmt::format("{} parameters x 4 bytes x 2 (fp32 weights and gradients) = {:.0f} bytes",
                                   parameters, 8 * parameters)),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("of max_bytes"), std::string::npos) << error;
  EXPECT_TRUE(LoadHfCheckpoint(kReference / "real_smollm_135m",
                               {.max_batch = 1, .max_seq_len = kContext, .max_bytes = uint64_t(8 * parameters)})
                  .ok());
  EXPECT_GT(PhysicalMemoryBytes(), uint64_t(1) << 28);

  // At the config's own context, 131072 tokens, Llama 3.2's attention arena
  // alone is terabytes: refused, naming the context.
  const std::string arena = LoadError(kReference / "real_llama32_1b", {.max_batch = 1});
  EXPECT_NE(arena.find("the activation arena for 1 x 131072 tokens"), std::string::npos) << arena;
  EXPECT_NE(arena.find("load at a shorter context"), std::string::npos) << arena;
}

// Under recompute the arena holds one block's activations, not num_layers:
// the memory check counts that arena, so a context refused without
// recompute loads with it, and the refusal line's bytes are the formula's.
TEST(HfCheckpointLimits, RecomputeIsCheckedAgainstItsOwnSmallerArena) {
  testing::TempDir tmp;
  LlamaConfig c;
  c.vocab_size = 256, c.hidden_size = 32, c.intermediate_size = 64, c.num_layers = 4, c.num_heads = 4;
  c.num_kv_heads = 2, c.max_seq_len = 256;
  auto model = Llama::Create(c, 1);
  ASSERT_TRUE(model.ok());
  model->Initialize(1);
  ASSERT_TRUE(SaveHfCheckpoint(tmp / "tiny", *model).ok());
  // One block's activations for one sequence: attention weights, then the
  // per-token rows (two norms' inputs and outputs, q/k/v, the attention's
  // output, gate, up and their product), as ActivationsPerSequence counts them.
  const double S = c.max_seq_len, H = c.num_heads, hd = c.head_dim();
  const double block = H * S * S + S * (4 * c.hidden_size + (2 * H + 2 * c.num_kv_heads) * hd + 3 * c.intermediate_size);
  const double plain = c.ActivationsPerSequence() * 4, recomputed = plain - 3 * block * 4;
  ASSERT_LT(8 * c.ParameterCount(), recomputed) << "the weights are not what is refused";
  // The model's own arenas shrink by about the same three blocks: ActivationsPerSequence is an estimate
  // (the carved block also holds the norms' statistics and rounds every slice to 16 floats; 2 % here).
  auto plain_model = Llama::Create(c, 1, false);
  auto recompute_model = Llama::Create(c, 1, true);
  ASSERT_TRUE(plain_model.ok() && recompute_model.ok());
  const double carved_saving = double(plain_model->activation_arena().size_bytes()) -
                               double(recompute_model->activation_arena().size_bytes());
  EXPECT_NEAR(plain - recomputed, carved_saving, 0.05 * carved_saving);

  const uint64_t limit = uint64_t(recomputed);  // fits recompute's arena exactly, not the plain one
  const std::string refused = LoadError(tmp / "tiny", {.max_batch = 1, .max_bytes = limit});
  EXPECT_EQ(refused, fmt::format("{}: the activation arena for 1 x 256 tokens (max_position_embeddings, or the context "
                                 "asked for) would map {:.0f} bytes ({:.2f} GiB), more than the {} bytes ({:.2f} GiB) "
                                 "of max_bytes; load at a shorter context, or with recompute",
                                 (tmp / "tiny").string(), plain, plain / (1 << 30), limit, double(limit) / (1 << 30)));
  auto loaded = LoadHfCheckpoint(tmp / "tiny", {.max_batch = 1, .max_bytes = limit, .recompute = true});
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_TRUE(loaded->recompute());
  // One byte less and recompute's arena is refused, with its own arithmetic.
  EXPECT_EQ(LoadError(tmp / "tiny", {.max_batch = 1, .max_bytes = limit - 1, .recompute = true}),
            fmt::format("{}: the activation arena for 1 x 256 tokens (max_position_embeddings, or the context asked "
                        "for) with recompute (one block's activations, not 4) would map {:.0f} bytes ({:.2f} GiB), "
                        "more than the {} bytes ({:.2f} GiB) of max_bytes; load at a shorter context",
                        (tmp / "tiny").string(), recomputed, recomputed / (1 << 30), limit - 1,
                        double(limit - 1) / (1 << 30)));
}

TEST(HfCheckpointConfig, ArchitecturesAndWindowsItCannotRunAreRefused) {
  testing::TempDir tmp;
  const fs::path dir = CopyOf("real_smollm_135m", tmp);
  const fs::path config_path = dir / "config.json";
  const nlohmann::json original = ReadJson(config_path);
  auto with = [&](std::initializer_list<std::pair<const char*, nlohmann::json>> changes) {
    nlohmann::json j = original;
    for (const auto& [key, value] : changes) j[key] = value;
    WriteJson(config_path, j);
  };

  with({{"architectures", {"GemmaForCausalLM"}}, {"model_type", "gemma"}});
  EXPECT_EQ(LoadError(dir), config_path.string() +
                                ": 'architectures' is [\"GemmaForCausalLM\"]; expected it to list LlamaForCausalLM, "
                                "MistralForCausalLM or Qwen2ForCausalLM");

  // Mistral: the same decoder when its window covers the context.
  with({{"architectures", {"MistralForCausalLM"}}, {"model_type", "mistral"}, {"sliding_window", nullptr}});
  auto mistral = LoadHfCheckpoint(dir, {.max_batch = 1, .max_seq_len = kContext});
  ASSERT_TRUE(mistral.ok()) << mistral.status().ToString();
  EXPECT_EQ(mistral->config().architecture, "MistralForCausalLM");
  with({{"architectures", {"MistralForCausalLM"}}, {"model_type", "mistral"}, {"sliding_window", kContext}});
  EXPECT_TRUE(LoadHfCheckpoint(dir, {.max_batch = 1, .max_seq_len = kContext}).ok());
  with({{"architectures", {"MistralForCausalLM"}}, {"model_type", "mistral"}, {"sliding_window", 16}});
  EXPECT_EQ(LoadError(dir), config_path.string() +
                                ": 'sliding_window' is 16, shorter than the context of 32 the model would run at; "
                                "sliding-window attention is not supported (run at a context of at most 16)");
  with({{"architectures", {"MistralForCausalLM"}}, {"model_type", "llama"}});
  EXPECT_EQ(LoadError(dir), config_path.string() + ": 'model_type' is \"llama\"; only \"mistral\" is supported");

  with({{"max_position_embeddings", 16}});
  EXPECT_EQ(LoadError(dir), config_path.string() + ": a context of 32 is longer than max_position_embeddings 16");
  with({{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}}});
  EXPECT_NE(LoadError(dir).find("'rope_scaling' is {\"factor\":4.0,\"rope_type\":\"yarn\"}; only rope_type "
                                "\"default\", \"linear\" and \"llama3\" are supported"),
            std::string::npos);
  with({{"rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}}}});
  EXPECT_EQ(LoadError(dir),
            config_path.string() + ": 'rope_scaling.low_freq_factor' is missing (rope_type \"llama3\")");
  with({{"head_dim", 63}});
  EXPECT_EQ(LoadError(dir), config_path.string() + ": llama config: head_dim 63 is odd; RoPE rotates pairs");
  // A head_dim other than hidden / heads changes q_proj's shape: the file must agree.
  with({{"head_dim", 32}});
  EXPECT_EQ(LoadError(dir), (dir / "model.safetensors").string() +
                                ": tensor 'model.layers.0.self_attn.q_proj.weight' has shape [576, 576], but "
                                "config.json implies [288, 576]");
  with({{"attention_bias", true}});
  EXPECT_EQ(LoadError(dir),
            (dir / "model.safetensors").string() + ": tensor 'model.layers.0.self_attn.q_proj.bias' is missing");
  with({});
  EXPECT_TRUE(LoadHfCheckpoint(dir, {.max_batch = 1, .max_seq_len = kContext}).ok());
}

// ------------------------------------------------------- estuary-lm inspect

// The config.json files the published models ship (as their repositories hold
// them), with the parameter counts their model cards state.
struct Published {
  const char* name;
  const char* config;
  int64_t parameters;
};
const Published kPublished[] = {
    {"SmolLM-135M",
     R"({"architectures":["LlamaForCausalLM"],"attention_bias":false,"attention_dropout":0.0,"bos_token_id":0,
         "eos_token_id":0,"hidden_act":"silu","hidden_size":576,"initializer_range":0.02,"intermediate_size":1536,
         "max_position_embeddings":2048,"model_type":"llama","num_attention_heads":9,"num_hidden_layers":30,
         "num_key_value_heads":3,"pretraining_tp":1,"rms_norm_eps":1e-05,"rope_scaling":null,"rope_theta":10000.0,
         "tie_word_embeddings":true,"torch_dtype":"float32","transformers_version":"4.40.1","use_cache":true,
         "vocab_size":49152})",
     134515008},
    {"TinyLlama-1.1B",
     R"({"architectures":["LlamaForCausalLM"],"bos_token_id":1,"eos_token_id":2,"hidden_act":"silu",
         "hidden_size":2048,"initializer_range":0.02,"intermediate_size":5632,"max_position_embeddings":2048,
         "model_type":"llama","num_attention_heads":32,"num_hidden_layers":22,"num_key_value_heads":4,
         "pretraining_tp":1,"rms_norm_eps":1e-05,"rope_scaling":null,"rope_theta":10000.0,
         "tie_word_embeddings":false,"torch_dtype":"bfloat16","transformers_version":"4.35.0","use_cache":true,
         "vocab_size":32000})",
     1100048384},
    {"Llama-3.2-1B",
     R"({"architectures":["LlamaForCausalLM"],"attention_bias":false,"attention_dropout":0.0,
         "bos_token_id":128000,"eos_token_id":128001,"head_dim":64,"hidden_act":"silu","hidden_size":2048,
         "initializer_range":0.02,"intermediate_size":8192,"max_position_embeddings":131072,"mlp_bias":false,
         "model_type":"llama","num_attention_heads":32,"num_hidden_layers":16,"num_key_value_heads":8,
         "pretraining_tp":1,"rms_norm_eps":1e-05,"rope_scaling":{"factor":32.0,"high_freq_factor":4.0,
         "low_freq_factor":1.0,"original_max_position_embeddings":8192,"rope_type":"llama3"},
         "rope_theta":500000.0,"tie_word_embeddings":true,"torch_dtype":"bfloat16",
         "transformers_version":"4.45.0.dev0","use_cache":true,"vocab_size":128256})",
     1235814400},
    {"Qwen2-0.5B",
     R"({"architectures":["Qwen2ForCausalLM"],"attention_dropout":0.0,"bos_token_id":151643,
         "eos_token_id":151643,"hidden_act":"silu","hidden_size":896,"initializer_range":0.02,
         "intermediate_size":4864,"max_position_embeddings":131072,"max_window_layers":24,"model_type":"qwen2",
         "num_attention_heads":14,"num_hidden_layers":24,"num_key_value_heads":2,"rms_norm_eps":1e-06,
         "rope_theta":1000000.0,"sliding_window":131072,"tie_word_embeddings":true,"torch_dtype":"bfloat16",
         "transformers_version":"4.40.1","use_cache":true,"use_sliding_window":false,"vocab_size":151936})",
     494032768},
    {"Mistral-7B-v0.1",
     R"({"architectures":["MistralForCausalLM"],"bos_token_id":1,"eos_token_id":2,"hidden_act":"silu",
         "hidden_size":4096,"initializer_range":0.02,"intermediate_size":14336,"max_position_embeddings":32768,
         "model_type":"mistral","num_attention_heads":32,"num_hidden_layers":32,"num_key_value_heads":8,
         "rms_norm_eps":1e-05,"rope_theta":10000.0,"sliding_window":4096,"tie_word_embeddings":false,
         "torch_dtype":"bfloat16","transformers_version":"4.34.0.dev0","use_cache":true,"vocab_size":32000})",
     7241732096},
};

const std::string kLm = std::string(ESTUARY_BINARY_DIR) + "/models/estuary-lm";

TEST(EstuaryLmInspect, PublishedConfigsGiveTheirModelCardsParameterCounts) {
  testing::TempDir tmp;
  for (const Published& p : kPublished) {
    const fs::path dir = tmp / p.name;
    fs::create_directories(dir);
    std::ofstream(dir / "config.json") << p.config;
    auto run = testing::RunCommand(kLm + " inspect --model " + dir.string());
    ASSERT_EQ(run.exit_code, 0) << p.name << ": " << run.output;
    const nlohmann::json out = nlohmann::json::parse(run.output, nullptr, false);
    ASSERT_FALSE(out.is_discarded()) << run.output;
    const nlohmann::json config = nlohmann::json::parse(p.config);
    EXPECT_EQ(out["architecture"], config["architectures"][0]) << p.name;
    EXPECT_EQ(out["parameters"], p.parameters) << p.name;
    EXPECT_EQ(out["bytes"]["weights_f32"], 4 * p.parameters) << p.name;
    EXPECT_EQ(out["bytes"]["weights_bf16"], 2 * p.parameters) << p.name;
    EXPECT_EQ(out["bytes"]["training_f32_adamw"], 16 * p.parameters) << p.name;
    for (const char* key : {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                            "num_key_value_heads", "vocab_size", "max_position_embeddings"}) {
      EXPECT_EQ(out["config"][key], config[key]) << p.name << " " << key;
    }
    EXPECT_EQ(out["config"]["head_dim"], config["hidden_size"].get<int>() / config["num_attention_heads"].get<int>());
  }
}

TEST(EstuaryLmInspect, ErrorsAreOneLine) {
  testing::TempDir tmp;
  std::ofstream(tmp / "config.json") << R"({"architectures":["GemmaForCausalLM"],"model_type":"gemma"})";
  auto run = testing::RunCommand(kLm + " inspect --model " + tmp.path().string());
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_EQ(run.output, "estuary-lm: " + (tmp / "config.json").string() +
                            ": 'architectures' is [\"GemmaForCausalLM\"]; expected it to list LlamaForCausalLM, "
                            "MistralForCausalLM or Qwen2ForCausalLM\n");
  run = testing::RunCommand(kLm + " inspect --model " + (tmp / "absent").string());
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_EQ(run.output, "estuary-lm: " + (tmp / "absent/config.json").string() +
                            ": cannot open: No such file or directory\n");
}

}  // namespace
}  // namespace estuary::models
