// LoraLlamaEngine: LoRA fine-tuning of the LLaMA decoder on one GPU — the
// device twin of models::LoraLlama (models/lora.h), which is its reference; a
// cuda::Engine (models/cuda/engine.h) whose flat buffer is the adapters.
//
// Same LoraConfig and the same adapter layout (models::LoraLayoutOf: PEFT's
// names, order and offsets), so adapter buffers, adapter files and federated
// LoRA updates copy one to one between the CPU model and this engine. Each
// adapted projection W [out, in] computes
//   y = x·Wᵀ + (alpha / rank) · (x·Aᵀ)·Bᵀ,   A [rank, in], B [out, rank]
// with q, k, v column blocks of the fused qkv output and gate, up of gate_up.
//
// The base is a cuda::LlamaEngine created frozen (LlamaEngineOptions
// train_base = false) with this engine as its ProjectionAdapters: the
// decoder's forward and backward are the base engine's own, not a copy; the
// adapters are added right after each base GEMM, and backward forms no base
// weight gradient (no dW GEMM, no base gradient buffer, no base optimizer
// state, no first-block input gradient). Only the adapter buffer trains:
//
//   auto lora = LoraLlamaEngine::Create(config, {.rank = 8, .alpha = 16}, max_batch, {.precision = DType::kBF16});
//   lora->base().CopyParametersFrom(base_weights);           // the frozen model
//   lora->Initialize(seed);                                   // PEFT init: B = 0
//   auto opt = cuda::AdamW::Create(lora->parameter_count(), options, lora->stream());
//   ESTUARY_RETURN_IF_ERROR(lora->ForwardBackwardAsync(tokens, targets, batch, seq));
//   ESTUARY_ASSIGN_OR_RETURN(bool stepped, lora->Step(*opt));
//
// Precision: f32 or bf16, as the base. The adapters are fp32 master weights
// with fp32 gradients and optimizer state; under bf16 they also have a bf16
// working copy that their GEMMs read (written by the fused AdamW step and by
// CopyParametersFrom, as the base's), and the products x·Aᵀ kept for backward
// are bf16, as PEFT's under autocast. f16 is refused: its loss scaler would
// have to unscale the adapter gradients, which is not written yet. Dropout
// (lora_dropout > 0) is refused on the GPU: the CPU model has it.
//
// Memory beyond the frozen base (parameters, bf16 working copy, activations):
// the adapters (4 bytes each, plus 2 under bf16), their gradients (4), AdamW's
// moments (8), and the kept products x·Aᵀ, [max_batch * max_seq_len, rank] per
// adapter. All allocated at Create: a step allocates nothing.
//
// Everything runs on the base engine's stream, with its cuBLAS handle; the
// same synchronisation rules as LlamaEngine. Not thread-safe.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>

#include "base/status.h"
#include "models/cuda/engine.h"
#include "models/cuda/llama_engine.h"
#include "models/cuda/optimizer.h"
#include "models/llama.h"
#include "models/lora.h"
#include "models/step_hooks.h"
#include "models/tensor.h"

namespace estuary::models::cuda {

// Beyond Engine: the flat buffer is the adapters'. manifest() equals
// models::LoraLlama's for the same configs (and units() its units, one per
// layer), Initialize draws models::InitializeLoraAdapters's bits (PEFT's init:
// B = 0), and Step always runs (without f16 there is nothing to skip).
class LoraLlamaEngine : public Engine {
 public:
  // A frozen base with zero weights (load them through base()) and zero
  // adapters (Initialize or CopyParametersFrom), with activation memory for
  // max_batch sequences of max_seq_len tokens. options as LlamaEngine's;
  // train_base is forced false and adapters must be left null (this engine
  // is the adapter). Fails, naming the field, on an invalid config, dropout
  // > 0, f16, or no usable GPU.
  static Result<LoraLlamaEngine> Create(const LlamaConfig& config, const LoraConfig& lora, int max_batch,
                                        LlamaEngineOptions options = {});

  LoraLlamaEngine(LoraLlamaEngine&&) noexcept = default;
  LoraLlamaEngine& operator=(LoraLlamaEngine&&) noexcept = default;

  const LoraConfig& lora_config() const;
  // The frozen base: load or read its weights (CopyParametersFrom/To); its
  // gradients() is null and its Step refuses.
  LlamaEngine& base();
  const LlamaEngine& base() const;
  // Device bytes of the kept products x·Aᵀ and the backward scratch.
  size_t adapter_activation_bytes() const;

  Status Initialize(uint64_t seed) override;
  using Engine::CopyParametersFrom;
  // Host values into [offset, offset + host.size()) of the adapter buffer
  // (bounds checked), leaving the working copy as it was: for a few tensors
  // at a time, followed by RefreshWorkingCopy.
  Status CopyParametersFrom(uint64_t offset, std::span<const float> host);

  // As LlamaEngine's, checked as there: overwrites gradients() (every adapter
  // gradient, scaled by options.grad_scale) and leaves the mean loss on the
  // device. With hooks, GradientsFinal(0) once backward is enqueued (DDP and
  // ZeRO-1/2 over the adapter buffer; ZeRO-3 does not apply: no unit is
  // opened). Accumulate is refused.
  Status ForwardBackwardAsync(const int32_t* tokens, const int32_t* targets, int batch, int seq,
                              const BackwardOptions& options = {});
  Result<float> ForwardBackward(const int32_t* tokens, const int32_t* targets, int batch, int seq);
  // Logits [batch, seq, vocab] of the adapted model, to host memory (waits).
  Status Forward(const int32_t* tokens, int batch, int seq, float* logits);

 private:
  struct Impl;
  explicit LoraLlamaEngine(std::unique_ptr<Impl> impl);
  Impl& impl() const;
};

}  // namespace estuary::models::cuda
