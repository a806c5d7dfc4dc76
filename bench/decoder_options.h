// The decoder-shape flags every decoder benchmark takes (--vocab, --hidden,
// --intermediate, --layers, --heads, --kv-heads, --seq), bound to a config
// that already holds the benchmark's defaults.
#pragma once

#include <CLI/CLI.hpp>

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

}  // namespace estuary::bench
