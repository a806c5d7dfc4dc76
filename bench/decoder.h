// For the decoder benchmarks: the decoder-shape flags (--vocab, --hidden,
// --intermediate, --layers, --heads, --kv-heads, --seq), bound to a config
// that already holds the benchmark's defaults, and a batch of random tokens.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <random>
#include <vector>

#include "models/llama.h"

namespace estuary::bench {

inline void AddDecoderOptions(CLI::App& app, models::LlamaConfig& c) {
  app.add_option("--vocab", c.vocab_size);
  app.add_option("--hidden", c.hidden_size);
  app.add_option("--intermediate", c.intermediate_size);
  app.add_option("--layers", c.num_layers);
  app.add_option("--heads", c.num_heads);
  app.add_option("--kv-heads", c.num_kv_heads);
  app.add_option("--seq", c.max_seq_len, "context length, and the sequence length of every step");
}

struct TokenBatch {
  std::vector<int32_t> tokens, targets;
};

// `count` tokens and as many targets below `vocab`, from one generator
// seeded with `seed`, the tokens drawn first. A step's time does not depend
// on them; the loss a benchmark prints does, so the seed stays fixed.
inline TokenBatch RandomTokens(size_t count, int vocab, uint32_t seed) {
  TokenBatch batch{std::vector<int32_t>(count), std::vector<int32_t>(count)};
  std::mt19937 rng(seed);
  for (auto& t : batch.tokens) t = int32_t(rng() % uint32_t(vocab));
  for (auto& t : batch.targets) t = int32_t(rng() % uint32_t(vocab));
  return batch;
}

}  // namespace estuary::bench
