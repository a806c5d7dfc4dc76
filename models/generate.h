// Text generation with the CPU Llama: an incremental decoder that keeps each
// layer's keys and values (a KV cache), and the generation loop on top of it.
//
//   ESTUARY_ASSIGN_OR_RETURN(Generation out, Generate(model, prompt_ids, {.max_new_tokens = 64}));
//
// KvCacheDecoder runs the prompt in one pass (prefill), then one token at a
// time, each step attending over the cached keys and values instead of
// recomputing the sequence. It reads the model's own parameters and RoPE
// tables (models/llama.h; it is Llama's friend) and calls the same ops as
// Llama::Forward, so its logits are Forward's on the whole sequence so far,
// up to the rounding of differently shaped GEMMs. The cache is
// [layers, kv_heads, positions, head_dim] for keys and again for values,
// after RoPE, with grouped-query attention reading one kv head per group.
// For an adapted model, decode LoraLlama::Merged() (models/lora.h).
//
// Generate runs over any TokenDecoder: KvCacheDecoder on the CPU, or
// cuda::LlamaDecoder (models/cuda/llama_decoder.h), which runs a GPU
// engine's weights with a cache on the device. Sampling stays on the host, so
// the same logits give the same tokens on either.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "models/llama.h"
#include "models/sampling.h"

namespace estuary::models {

// What Generate needs of a decoder with a KV cache: append tokens at the next
// positions and get the logits that follow the last of them.
class TokenDecoder {
 public:
  virtual ~TokenDecoder() = default;
  virtual int vocab_size() const = 0;
  virtual int length() const = 0;  // positions cached so far
  virtual int capacity() const = 0;
  // Forgets every position: the next Append starts a new sequence.
  virtual void Clear() = 0;
  // Runs `tokens` at positions length() ... length() + size - 1, caches their
  // keys and values, and writes the logits that follow the last of them into
  // `logits` (vocab_size() floats). Fails, caching nothing, on an empty span,
  // an id outside the vocabulary, too small a logits span, or more positions
  // than capacity().
  virtual Status Append(std::span<const int32_t> tokens, std::span<float> logits) = 0;
  // Where and in what precision it runs, as the program reports it: "cpu f32",
  // "cuda:0 (NVIDIA H100 80GB HBM3) bf16".
  virtual std::string device() const = 0;
};

class KvCacheDecoder final : public TokenDecoder {
 public:
  // A decoder with room for `capacity` positions (0: the model's
  // max_seq_len, which bounds it). It points at `model`, which must outlive
  // it and keep its weights while it is used; one thread at a time.
  static Result<KvCacheDecoder> Create(const Llama& model, int capacity = 0);

  int vocab_size() const override { return model_->config().vocab_size; }
  int length() const override { return length_; }
  int capacity() const override { return capacity_; }
  void Clear() override { length_ = 0; }
  // TokenDecoder::Append, the tokens in one pass.
  Status Append(std::span<const int32_t> tokens, std::span<float> logits) override;
  std::string device() const override { return "cpu f32"; }

 private:
  KvCacheDecoder(const Llama& model, int capacity);
  // Grows the per-pass buffers to `rows` tokens (a prefill allocates; a
  // one-token step after it does not).
  void Reserve(int rows);
  // One layer's attention for the pass's `rows` tokens, caching their keys and values.
  void Attend(int layer, int rows);
  float* Keys(int layer, int kv_head) { return keys_.data() + CacheOffset(layer, kv_head); }
  float* Values(int layer, int kv_head) { return values_.data() + CacheOffset(layer, kv_head); }
  size_t CacheOffset(int layer, int kv_head) const;

  const Llama* model_;
  int capacity_ = 0, length_ = 0, reserved_rows_ = 0;
  std::vector<float> keys_, values_;
  // One pass's activations, [rows, width] each.
  std::vector<float> x_, xn_, rstd_, qkv_, scores_, attn_, h_, gate_up_, act_;
};

struct GenerateOptions {
  int max_new_tokens = 64;
  SamplingOptions sampling;
  // Generation ends after any of these (it is included in the output); the
  // tokenizer's EOS belongs here.
  std::vector<int32_t> stop_tokens;
};

struct Generation {
  std::vector<int32_t> tokens;  // the new tokens, a stop token last when one ended it
  // Per new token, its log-probability under the model (log-softmax of the
  // logits, before temperature and filtering), so that runs with different
  // sampling settings score alike.
  std::vector<double> log_probs;
  bool stopped = false;  // ended on a stop token rather than max_new_tokens
};

// Prefills `prompt` (at least one token) and generates up to max_new_tokens
// more, sampled per options.sampling. Fails on invalid options, a token
// outside the vocabulary, or when prompt and new tokens do not fit the
// context (the last new token is not fed back, so prompt.size() +
// max_new_tokens - 1 positions must fit max_seq_len).
Result<Generation> Generate(const Llama& model, std::span<const int32_t> prompt, const GenerateOptions& options);
// The same on `decoder`, which is cleared first and whose capacity() bounds
// the positions as max_seq_len does above.
Result<Generation> Generate(TokenDecoder& decoder, std::span<const int32_t> prompt, const GenerateOptions& options);

}  // namespace estuary::models
