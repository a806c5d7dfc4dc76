// The identity of a Hugging Face base (models/hf_base.h): one bit of one
// weight changes it; a sharded copy and a BF16 copy of the same
// bf16-representable values keep it. The canonical shape reads back, names
// the first key that differs, and a registered name keeps its shape.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <bit>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/checkpoint.h"
#include "models/hf_base.h"
#include "models/language_model.h"
#include "models/llama.h"
#include "tests/e2e/harness.h"

namespace estuary::models {
namespace {

namespace fs = std::filesystem;

LlamaConfig TinyConfig() {
  LlamaConfig c;
  c.vocab_size = 256, c.hidden_size = 32, c.intermediate_size = 64, c.num_layers = 2, c.num_heads = 4;
  c.num_kv_heads = 2, c.max_seq_len = 64;
  return c;
}

// A random model whose every weight is bf16-representable (the low 16 bits cleared).
Llama TinyModel() {
  auto model = Llama::Create(TinyConfig(), 1);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  model->Initialize(11);
  for (float& w : model->parameters()) w = std::bit_cast<float>(std::bit_cast<uint32_t>(w) & 0xffff0000u);
  return std::move(model).value();
}

// A safetensors file of `names` from `model`, each as BF16 (the top 16 bits) or F32.
void WriteSafetensors(const fs::path& path, const Llama& model, const std::vector<std::string>& names, bool bf16) {
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"}};
  std::string data;
  for (const std::string& name : names) {
    const TensorSpec* spec = model.manifest().Find(name);
    ASSERT_NE(spec, nullptr) << name;
    const size_t begin = data.size();
    for (uint64_t i = 0; i < spec->numel(); ++i) {
      const uint32_t bits = std::bit_cast<uint32_t>(model.parameters()[spec->offset + i]);
      if (bf16) {
        const uint16_t top = uint16_t(bits >> 16);
        data.append(reinterpret_cast<const char*>(&top), 2);
      } else {
        data.append(reinterpret_cast<const char*>(&bits), 4);
      }
    }
    header[name] = {{"dtype", bf16 ? "BF16" : "F32"}, {"shape", spec->shape}, {"data_offsets", {begin, data.size()}}};
  }
  const std::string text = header.dump();
  const uint64_t size = text.size();
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&size), 8);
  out << text << data;
}

class HfBaseIdentityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(SaveHfCheckpoint(dir_.path() / "f32", model_).ok());
    // The same values as BF16, and as two F32 shards with an index.
    fs::create_directories(dir_.path() / "bf16");
    fs::copy_file(dir_.path() / "f32" / "config.json", dir_.path() / "bf16" / "config.json");
    std::vector<std::string> names;
    for (const TensorSpec& t : model_.manifest().tensors) names.push_back(t.name);
    WriteSafetensors(dir_.path() / "bf16" / "model.safetensors", model_, names, true);
    fs::create_directories(dir_.path() / "sharded");
    fs::copy_file(dir_.path() / "f32" / "config.json", dir_.path() / "sharded" / "config.json");
    const size_t half = names.size() / 2;
    const std::vector<std::string> first(names.begin(), names.begin() + half), second(names.begin() + half, names.end());
    WriteSafetensors(dir_.path() / "sharded" / "model-00001-of-00002.safetensors", model_, first, false);
    WriteSafetensors(dir_.path() / "sharded" / "model-00002-of-00002.safetensors", model_, second, false);
    nlohmann::json index;
    index["metadata"] = nlohmann::json::object();
    for (const auto& n : first) index["weight_map"][n] = "model-00001-of-00002.safetensors";
    for (const auto& n : second) index["weight_map"][n] = "model-00002-of-00002.safetensors";
    std::ofstream(dir_.path() / "sharded" / "model.safetensors.index.json") << index.dump();
  }

  testing::TempDir dir_;
  Llama model_ = TinyModel();
};

TEST_F(HfBaseIdentityTest, ShardedAndBf16CopiesOfTheSameValuesShareIt) {
  auto f32 = LoadHfBase(dir_.path() / "f32");
  auto bf16 = LoadHfBase(dir_.path() / "bf16");
  auto sharded = LoadHfBase(dir_.path() / "sharded");
  ASSERT_TRUE(f32.ok()) << f32.status().ToString();
  ASSERT_TRUE(bf16.ok()) << bf16.status().ToString();
  ASSERT_TRUE(sharded.ok()) << sharded.status().ToString();
  EXPECT_EQ(f32->sha256.size(), 64u);
  EXPECT_EQ(bf16->sha256, f32->sha256);
  EXPECT_EQ(sharded->sha256, f32->sha256);
  EXPECT_EQ(f32->sha256, HfBaseIdentity(model_.config(), model_.parameters()));
  EXPECT_EQ(f32->ModelName(), "f32@" + f32->sha256.substr(0, 12));
}

TEST_F(HfBaseIdentityTest, OneBitOfOneWeightChangesIt) {
  auto f32 = LoadHfBase(dir_.path() / "f32");
  ASSERT_TRUE(f32.ok()) << f32.status().ToString();
  // The lowest mantissa bit of a weight deep in the buffer, then the file rewritten.
  const TensorSpec* down = model_.manifest().Find("model.layers.1.mlp.down_proj.weight");
  ASSERT_NE(down, nullptr);
  float& w = model_.parameters()[down->offset + 7];
  w = std::bit_cast<float>(std::bit_cast<uint32_t>(w) ^ 1u);
  ASSERT_TRUE(SaveHfCheckpoint(dir_.path() / "flipped", model_).ok());
  auto flipped = LoadHfBase(dir_.path() / "flipped");
  ASSERT_TRUE(flipped.ok()) << flipped.status().ToString();
  EXPECT_NE(flipped->sha256, f32->sha256);
  EXPECT_EQ(flipped->shape, f32->shape);
  // The shape counts as well: the same weights under another rope_theta.
  LlamaConfig other = model_.config();
  other.rope_theta = 500000;
  EXPECT_NE(HfBaseIdentity(other, f32->weights), f32->sha256);
}

TEST(HfBaseShape, ReadsBackAndNamesTheFirstKeyThatDiffers) {
  LlamaConfig c = TinyConfig();
  c.qkv_bias = true, c.explicit_head_dim = 16, c.rms_norm_eps = 1e-6, c.tie_embeddings = true;
  c.rope_scaling.kind = RopeScaling::Kind::kLlama3, c.rope_scaling.factor = 32;
  const std::string text = CanonicalShape(c);
  auto back = ParseCanonicalShape(text);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(CanonicalShape(*back), text);
  EXPECT_EQ(back->explicit_head_dim, 16);
  EXPECT_TRUE(back->qkv_bias);
  EXPECT_EQ(back->rms_norm_eps, 1e-6);
  LlamaConfig wider = c;
  wider.intermediate_size = 128;
  EXPECT_EQ(FirstShapeDifference(text, CanonicalShape(wider)), "intermediate_size: 64 vs 128");
  EXPECT_EQ(FirstShapeDifference(text, text), "");
  auto bad = ParseCanonicalShape("vocab_size=x\n");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "base model shape: vocab_size=x: expected an integer");
}

TEST(HfBaseShape, ARegisteredNameKeepsItsShape) {
  const LlamaConfig c = TinyConfig();
  ASSERT_TRUE(RegisterHfModel("tiny@000000000001", c).ok());
  EXPECT_TRUE(IsLanguageModel("tiny@000000000001"));
  auto got = LlamaPreset("tiny@000000000001");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(CanonicalShape(*got), CanonicalShape(c));
  EXPECT_TRUE(RegisterHfModel("tiny@000000000001", c).ok());  // the same again: fine
  LlamaConfig deeper = c;
  deeper.num_layers = 3;
  const Status clash = RegisterHfModel("tiny@000000000001", deeper);
  EXPECT_EQ(clash.message(),
            "model 'tiny@000000000001' is already this process's with another shape (num_hidden_layers: 2 vs 3)");
  EXPECT_FALSE(IsLanguageModel("tiny@000000000002"));
}

TEST(HfBaseLoad, ADirectoryWithoutConfigIsOneLine) {
  testing::TempDir dir;
  auto base = LoadHfBase(dir.path());
  ASSERT_FALSE(base.ok());
  EXPECT_EQ(base.status().message(),
            fmt::format("base model {}: not a Hugging Face model directory (no config.json)", dir.path().string()));
}

}  // namespace
}  // namespace estuary::models
