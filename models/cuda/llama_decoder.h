// LlamaDecoder: cached generation on the GPU, with a LlamaEngine's weights —
// the device twin of models::KvCacheDecoder (models/generate.h), which is its
// reference, behind the same TokenDecoder interface so that models::Generate
// runs on either:
//
//   ESTUARY_ASSIGN_OR_RETURN(cuda::LlamaDecoder decoder, cuda::LlamaDecoder::Create(engine));
//   ESTUARY_ASSIGN_OR_RETURN(Generation out, Generate(decoder, prompt_ids, {.max_new_tokens = 64}));
//
// It reads the engine's device weights in place (the working copy under
// bf16/f16, the fp32 master under f32; the norms and embedding as the
// engine's forward reads them) and runs the engine's forward ops on its
// stream with its cuBLAS handle, one sequence (batch 1) at a time: a chunk of
// tokens at positions [length, length + n) gets RoPE at those positions
// (the engine's tables, offset), appends its keys and values to the cache,
// and attends over cache positions [0, length + n), causally within the
// chunk. When the engine carries ProjectionAdapters (a LoraLlamaEngine's
// base), they are called after each projection as in the engine's forward.
//
// The cache is [layers, kv_heads, capacity, head_dim] for keys and again for
// values, after RoPE, in the activation dtype (what the engine's attention
// reads). Attention is one warp per (query row, head), looping over the keys
// with an online softmax in fp32; the GEMMs and the other ops are the
// engine's, so under f32 the logits are the CPU decoder's up to the rounding
// of differently shaped products. Only the last row goes through the final
// norm and the LM head; Append copies those vocab_size fp32 logits to the
// host (it waits for the stream).
//
// The engine must outlive the decoder and not run a training step between
// Appends that the cache should survive (the weights would change under it).
// Per-pass buffers grow to the longest chunk seen (a prefill allocates, steps
// after it do not). Not thread-safe; one thread drives engine and decoder.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "base/status.h"
#include "models/cuda/llama_engine.h"
#include "models/generate.h"

namespace estuary::models::cuda {

class LlamaDecoder final : public TokenDecoder {
 public:
  // A decoder with room for `capacity` positions (0: the config's
  // max_seq_len, which bounds it). Fails on a capacity outside [1,
  // max_seq_len] or when the cache cannot be allocated.
  static Result<LlamaDecoder> Create(LlamaEngine& engine, int capacity = 0);

  LlamaDecoder(LlamaDecoder&&) noexcept;
  LlamaDecoder& operator=(LlamaDecoder&&) noexcept;
  ~LlamaDecoder() override;

  int vocab_size() const override;
  int length() const override;
  int capacity() const override;
  void Clear() override;
  // TokenDecoder::Append; the same checks and one-line messages as
  // KvCacheDecoder's, prefixed "cuda kv cache:".
  Status Append(std::span<const int32_t> tokens, std::span<float> logits) override;
  // "cuda:<ordinal> (<device name>) <f32|bf16|f16>", read from the runtime at Create.
  std::string device() const override;
  // Device bytes of the key and value cache.
  size_t cache_bytes() const;

 private:
  struct Impl;
  explicit LlamaDecoder(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace estuary::models::cuda
