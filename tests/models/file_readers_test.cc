// What fuzzing (fuzz/, docs/FUZZING.md) found in the readers of model files,
// each as the input that broke it: safetensors checkpoints, Hugging Face model
// directories and PEFT adapters. The same inputs sit in fuzz/corpus as
// regression files, which ctest's fuzz.* tests replay.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "models/checkpoint.h"
#include "models/llama.h"
#include "models/lora.h"
#include "tests/e2e/harness.h"

namespace estuary::models {
namespace {

namespace fs = std::filesystem;
using estuary::testing::TempDir;

void Write(const fs::path& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

// A safetensors file: the 8-byte little-endian header length, the header, the data.
std::string Safetensors(const std::string& header, const std::string& data = "") {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char((header.size() >> (8 * i)) & 0xff);
  return out + header + data;
}

TEST(SafetensorsReader, ReadsAFileWithNoDataAndWritesOneBack) {
  // Once: memcpy from a null pointer (UBSan) on an empty data section, and
  // SaveCheckpoint wrote an empty manifest's header as "null", which it then refused.
  TempDir dir;
  Write(dir / "empty.safetensors", Safetensors("{}"));
  auto empty = LoadCheckpoint(dir / "empty.safetensors");
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_TRUE(empty->manifest.tensors.empty());
  EXPECT_TRUE(empty->data.empty());
  ASSERT_TRUE(SaveCheckpoint(dir / "copy.safetensors", empty->manifest, empty->data).ok());
  auto again = LoadCheckpoint(dir / "copy.safetensors");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(again->manifest == empty->manifest);
}

TEST(SafetensorsReader, RefusesADtypeThatIsNotAString) {
  // Once: nlohmann's value("dtype", "") threw type_error, and the program ended in std::terminate.
  TempDir dir;
  Write(dir / "m.safetensors", Safetensors(R"({"w":{"dtypeC":"F32","dtype":[1],"offsets":[0,4]}})", "\0\0\0\xc1"));
  auto loaded = LoadCheckpoint(dir / "m.safetensors");
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("tensor 'w' needs dtype F32"), std::string::npos)
      << loaded.status().message();
}

TEST(SafetensorsReader, RefusesAShapeWhoseElementCountOverflows) {
  // 2^32 x 2^32 elements wraps to 0 in 64 bits: once a tensor of no data.
  TempDir dir;
  Write(dir / "m.safetensors",
        Safetensors(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})"));
  auto loaded = LoadCheckpoint(dir / "m.safetensors");
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("tensor 'w' has more than"), std::string::npos)
      << loaded.status().message();
}

TEST(SafetensorsReader, AnErrorIsOneLineWhateverTheNamesHold) {
  // Once: a tensor named "a\nb" split the error (and a log line) in two.
  TempDir dir;
  Write(dir / "m.safetensors", Safetensors(R"({"a\nb":{"dtype":"F32","shape":[3],"data_offsets":[0,4]}})", "abcdefgh"));
  auto loaded = LoadCheckpoint(dir / "m.safetensors");
  ASSERT_FALSE(loaded.ok());
  const std::string& message = loaded.status().message();
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  EXPECT_NE(message.find("'a\\nb'"), std::string::npos) << message;
}

LlamaConfig Tiny() {
  LlamaConfig c;
  c.vocab_size = 8;
  c.hidden_size = 4;
  c.intermediate_size = 6;
  c.num_layers = 1;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.max_seq_len = 4;
  return c;
}

TEST(HfCheckpointReader, ChecksTheFileBeforeMakingTheModelItsConfigDescribes) {
  // Once: a config.json whose absent keys take Hugging Face's defaults (a 7B
  // model) made the loader map 27 GB for parameters and gradients before it
  // looked at model.safetensors, and abort when the kernel refused.
  TempDir dir;
  auto model = Llama::Create(Tiny(), 1);
  ASSERT_TRUE(model.ok());
  ASSERT_TRUE(SaveHfCheckpoint(dir.path(), *model).ok());
  Write(dir / "config.json", R"({"num_hidden_layers":1,"max_position_embeddings":8})");
  auto loaded = LoadHfCheckpoint(dir.path());
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("tensor 'model.embed_tokens.weight' has shape [8, 4], but config.json "
                                           "implies [32000, 4096]"),
            std::string::npos)
      << loaded.status().message();
}

TEST(HfCheckpointReader, RefusesSizesWhoseCountsOverflow) {
  // Every size may be up to INT_MAX; their products must not wrap.
  TempDir dir;
  Write(dir / "config.json", R"({"vocab_size":2147483647,"hidden_size":2147483646,"intermediate_size":2147483647,
                                 "num_hidden_layers":2147483647,"num_attention_heads":1,"num_key_value_heads":1})");
  Write(dir / "model.safetensors", Safetensors("{}"));
  auto loaded = LoadHfCheckpoint(dir.path());
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("do not fit an int"), std::string::npos) << loaded.status().message();
  LlamaConfig c = Tiny();
  c.num_layers = 1 << 30;
  c.vocab_size = 1 << 30;
  c.hidden_size = 1 << 20;
  EXPECT_FALSE(c.Validate().ok());
  c = Tiny();
  c.max_seq_len = 1 << 30;  // num_heads x max_seq_len^2 attention weights per layer
  EXPECT_FALSE(c.Validate().ok());
}

TEST(HfCheckpointReader, CountsTheTensorsBeforeNamingThemAll) {
  // Once (CI's fuzzing): 200 bytes of config.json claiming three million
  // layers made the loader name 27 million tensors, 2.5 GB, before it
  // compared them with a file that held one.
  TempDir dir;
  Write(dir / "config.json", R"({"vocab_size":1,"hidden_size":2,"intermediate_size":1,"num_hidden_layers":3000000,
                                 "num_attention_heads":1,"num_key_value_heads":1,"max_position_embeddings":1})");
  Write(dir / "model.safetensors",
        Safetensors(R"({"model.embed_tokens.weight":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]}})",
                    std::string(8, '\0')));
  auto loaded = LoadHfCheckpoint(dir.path());
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("config.json implies 27000003 tensors (3000000 layers), but the file "
                                           "holds 1"),
            std::string::npos)
      << loaded.status().message();
  for (bool tied : {false, true}) {
    LlamaConfig c = Tiny();
    c.tie_embeddings = tied;
    EXPECT_EQ(TensorCountOf(c), int64_t(LayoutOf(c).manifest.tensors.size())) << "tied " << tied;
  }
}

TEST(HfCheckpointReader, RefusesARopeTypeThatIsNotAString) {
  // Once: rope.value("rope_type", ...) threw type_error on a number.
  TempDir dir;
  auto model = Llama::Create(Tiny(), 1);
  ASSERT_TRUE(model.ok());
  ASSERT_TRUE(SaveHfCheckpoint(dir.path(), *model).ok());
  nlohmann::json json;
  std::ifstream(dir / "config.json") >> json;
  json["rope_parameters"] = {{"rope_type", 7}};
  Write(dir / "config.json", json.dump());
  auto loaded = LoadHfCheckpoint(dir.path());
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("only rope_type \"default\", \"linear\" and \"llama3\" are supported"),
            std::string::npos)
      << loaded.status().message();
}

TEST(PeftReader, RefusesANumberAFloatCannotHold) {
  // Once: lora_alpha 1e300 was made a float (undefined behaviour, UBSan).
  TempDir dir;
  Write(dir / "adapter_config.json", R"({"r":2,"lora_alpha":1e300,"target_modules":["q_proj"]})");
  auto config = ReadLoraConfig(dir.path());
  ASSERT_FALSE(config.ok());
  EXPECT_NE(config.status().message().find("'lora_alpha' is 1e+300; expected a number"), std::string::npos)
      << config.status().message();
  Write(dir / "adapter_config.json", R"({"r":2,"lora_alpha":4,"lora_dropout":-1e39,"target_modules":["q_proj"]})");
  EXPECT_FALSE(ReadLoraConfig(dir.path()).ok());
}

}  // namespace
}  // namespace estuary::models
