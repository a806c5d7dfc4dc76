// A tiny random Llama (byte vocabulary, 2 layers of width 64, GQA) written as
// a Hugging Face model directory: the base the HF-base federation tests
// (simulator, e2e) start from.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <utility>

#include "models/llama.h"

namespace estuary::testing {

inline models::LlamaConfig TinyHfConfig() {
  models::LlamaConfig c;
  c.vocab_size = 256, c.hidden_size = 64, c.intermediate_size = 128, c.num_layers = 2, c.num_heads = 4;
  c.num_kv_heads = 2, c.max_seq_len = 64;
  return c;
}

// Writes the model drawn from `seed` to each of `dirs` (a server's and a
// site's copy are the same bits) and returns it.
inline models::Llama WriteTinyHfBase(std::initializer_list<std::filesystem::path> dirs, uint64_t seed) {
  auto model = models::Llama::Create(TinyHfConfig(), 1);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  model->Initialize(seed);
  for (const auto& dir : dirs) EXPECT_TRUE(models::SaveHfCheckpoint(dir, *model).ok()) << dir;
  return std::move(model).value();
}

}  // namespace estuary::testing
