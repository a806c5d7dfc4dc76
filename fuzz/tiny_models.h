// The small decoder and adapters the PEFT and Hugging Face targets load into,
// and whose files the corpus writer saves as seeds: a real LlamaForCausalLM
// layout (two layers, grouped-query attention, untied head) small enough that
// a run costs microseconds.
#pragma once

#include "models/llama.h"
#include "models/lora.h"

namespace estuary::fuzz {

inline models::LlamaConfig TinyLlamaConfig() {
  models::LlamaConfig c;
  c.vocab_size = 8;
  c.hidden_size = 4;
  c.intermediate_size = 6;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.max_seq_len = 4;
  return c;
}

inline models::LoraConfig TinyLoraConfig() {
  models::LoraConfig c;
  c.rank = 2;
  c.alpha = 4;
  c.target_modules = {"q_proj", "v_proj", "down_proj"};
  c.base_model_name_or_path = "tiny-llama";
  return c;
}

}  // namespace estuary::fuzz
