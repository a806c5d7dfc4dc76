// Reading the PyTorch references torch_llama.py writes (the models_torch_llama
// ctest fixture) for the decoder's tests: the JSON files, their tensors, the
// model they describe, and the error metric every comparison uses,
// max|a - b| / max|b| over a tensor.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <span>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/llama.h"

namespace estuary::models::fixture {

// The Python that runs the torch oracle: ESTUARY_TORCH_PYTHON from the
// environment (a machine whose torch lives elsewhere), else the one CMake found.
inline std::string TorchPython() {
  const char* from_env = std::getenv("ESTUARY_TORCH_PYTHON");
  return from_env && *from_env ? from_env : ESTUARY_TORCH_PYTHON;
}

using Values = std::vector<float>;
using Ids = std::vector<int32_t>;

inline const std::filesystem::path kReference =
    std::filesystem::path(ESTUARY_BINARY_DIR) / "tests/models/llama_reference";

inline nlohmann::json Fixture(const std::string& name) {
  std::ifstream in(kReference / (name + ".json"));
  EXPECT_TRUE(in.good()) << "missing fixture " << name << " (the models_torch_llama step writes it)";
  return nlohmann::json::parse(in, nullptr, false);
}

inline Values Get(const nlohmann::json& f, const std::string& key) { return f.at(key).get<Values>(); }

inline Ids GetIds(const nlohmann::json& f, const std::string& key) {
  Ids ids;
  for (double v : f.at(key)) ids.push_back(int32_t(v));
  return ids;
}

inline double RelativeError(const float* a, const Values& b) {
  double diff = 0, scale = 1e-30;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, double(std::abs(a[i] - b[i])));
    scale = std::max(scale, double(std::abs(b[i])));
  }
  return diff / scale;
}

// A Hugging Face config.json's keys, as the fixture stores them.
inline LlamaConfig ConfigFrom(const nlohmann::json& j) {
  LlamaConfig c;
  c.vocab_size = j["vocab_size"];
  c.hidden_size = j["hidden_size"];
  c.intermediate_size = j["intermediate_size"];
  c.num_layers = j["num_hidden_layers"];
  c.num_heads = j["num_attention_heads"];
  c.num_kv_heads = j["num_key_value_heads"];
  c.max_seq_len = j["max_position_embeddings"];
  c.rms_norm_eps = j["rms_norm_eps"];
  c.rope_theta = j["rope_theta"];
  c.tie_embeddings = j["tie_word_embeddings"];
  if (j.contains("head_dim") && !j["head_dim"].is_null()) c.explicit_head_dim = j["head_dim"];
  c.qkv_bias = j.value("qkv_bias", false);
  c.o_bias = j.value("o_bias", false);
  c.mlp_bias = j.value("mlp_bias", false);
  if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) {
    const auto& r = j["rope_scaling"];
    c.rope_scaling.kind = r["rope_type"] == "linear" ? RopeScaling::Kind::kLinear : RopeScaling::Kind::kLlama3;
    c.rope_scaling.factor = r["factor"];
    c.rope_scaling.low_freq_factor = r.value("low_freq_factor", 1.0);
    c.rope_scaling.high_freq_factor = r.value("high_freq_factor", 4.0);
    c.rope_scaling.original_max_position_embeddings = r.value("original_max_position_embeddings", 8192);
  }
  return c;
}

// Copies the fixture's tensors, by the manifest's names, into a flat buffer.
inline void LoadTensors(const nlohmann::json& f, const Manifest& manifest, std::span<float> flat) {
  for (const TensorSpec& t : manifest.tensors) {
    Values v = Get(f, t.name);
    EXPECT_EQ(v.size(), t.numel()) << t.name;
    std::copy(v.begin(), v.end(), flat.begin() + t.offset);
  }
}

// The manifest names and shapes the fixture's tensors in torch's order, and
// the flat buffers are exactly its size.
inline void ExpectManifestMatches(const Manifest& manifest, const nlohmann::json& names_json,
                                  const nlohmann::json& shapes_json, size_t parameters, size_t gradients) {
  const auto names = names_json.get<std::vector<std::string>>();
  const auto shapes = shapes_json.get<std::vector<std::vector<int64_t>>>();
  ASSERT_EQ(manifest.tensors.size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(manifest.tensors[i].name, names[i]);
    EXPECT_EQ(manifest.tensors[i].shape, shapes[i]) << names[i];
  }
  EXPECT_TRUE(manifest.Validate().ok());
  EXPECT_EQ(parameters, manifest.total_elements);
  EXPECT_EQ(gradients, manifest.total_elements);
}

// The fixture's decoder: its config, with its weights loaded by name.
inline Llama LoadFixtureDecoder(const nlohmann::json& f, int max_batch, bool recompute = false) {
  auto model = Llama::Create(ConfigFrom(f["config"]), max_batch, recompute);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  LoadTensors(f, model->manifest(), model->parameters());
  return std::move(model).value();
}

// After one step at (batch, seq), three at smaller shapes allocate nothing:
// arenas and scratch are sized once. `allocations` counts operator new calls
// (each test binary replaces operator new to count them).
template <typename Model>
void ExpectStepsDoNotAllocate(Model& model, const Ids& tokens, const Ids& targets, int batch, int seq,
                              const std::atomic<int64_t>& allocations) {
  ASSERT_TRUE(model.ForwardBackward(tokens.data(), targets.data(), batch, seq).ok());
  const int64_t before = allocations.load();
  for (int i = 0; i < 3; ++i) {
    auto loss = model.ForwardBackward(tokens.data(), targets.data(), batch - 1 > 0 ? batch - 1 : 1, seq - i);
    if (!loss.ok()) FAIL() << loss.status().ToString();
  }
  EXPECT_EQ(allocations.load(), before);
}

}  // namespace estuary::models::fixture
