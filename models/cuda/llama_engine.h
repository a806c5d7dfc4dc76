// LlamaEngine: the LLaMA-style decoder of models/llama.h, trained on one GPU
// (a cuda::Engine, models/cuda/engine.h).
//
// Same LlamaConfig, same manifest (Hugging Face names, order and offsets) and
// so the same flat fp32 parameter buffer as models::Llama: weights, checkpoints
// and federated updates copy one to one between the two. The fp32 master
// parameters and the fp32 gradients live on the device; all activations come
// from one buffer sized at Create for (max_batch, max_seq_len), so a step
// never allocates.
//
// Attention: under bf16/f16 with head_dim 64, fused flash-attention kernels
// that keep one log-sum-exp per row (flash_attention.h); otherwise (f32,
// other head sizes, or when asked) cuBLAS products around a fused softmax,
// keeping the [batch, heads, seq, seq] probabilities for backward.
//
// Precision: f32 (fp32 GEMMs; TF32 only if asked), or bf16 / f16: GEMMs take a
// low-precision working copy of the weights and low-precision activations and
// accumulate in fp32; the residual stream, norm statistics, softmaxes, logits,
// loss and every gradient stay fp32. The working copy is written by the fused
// optimizer step (cuda::AdamW / cuda::Sgd with a WorkingCopy) and by
// CopyParametersFrom. f16 scales the loss by models::LossScaler's scale; Step
// unscales the gradients, checks them and skips the update, weights and
// optimizer state untouched, when any is inf or NaN.
//
//   auto engine = LlamaEngine::Create(config, max_batch, {.precision = DType::kBF16});
//   auto opt = cuda::AdamW::Create(engine->parameter_count(), options, engine->stream());
//   ESTUARY_RETURN_IF_ERROR(engine->ForwardBackwardAsync(tokens, targets, batch, seq));
//   ESTUARY_ASSIGN_OR_RETURN(bool stepped, engine->Step(*opt));
//
// All work is enqueued on the engine's stream. A step synchronises with the
// host only where its result is needed: ForwardBackward (not ...Async) reads
// the loss, and an f16 Step reads the one found-inf flag. Token ids are copied
// through a pinned staging buffer; before refilling it the host waits for the
// previous step's copy of it (its first operation), never for the step itself.
// Not thread-safe: one thread drives an engine.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "base/status.h"
#include "models/cuda/blas.h"
#include "models/cuda/device.h"
#include "models/cuda/engine.h"
#include "models/cuda/optimizer.h"
#include "models/llama.h"
#include "models/loss_scaler.h"
#include "models/step_hooks.h"
#include "models/tensor.h"

namespace estuary::models::cuda {

class LlamaDecoder;

// The four weight products of a block, as fused in the flat buffer
// (models::LlamaLayout): q/k/v in one [(H + 2 KV) hd, D] matrix, gate/up in
// one [2 I, D] matrix.
enum class Projection { kQkv, kO, kGateUp, kDown };

// Extra terms on the projections' outputs, run by the engine on its stream
// with its Blas: what cuda::LoraLlamaEngine (models/cuda/lora_engine.h) plugs
// in, so that LoRA reuses the decoder's forward and backward instead of
// copying them. For block `layer`'s projection p on n = batch * seq rows:
//   Forward:  y [n, fused out] (y_dtype, rows contiguous) += f(x), x [n, in]
//             in the activation dtype; called right after the base GEMM,
//             before anything reads y (q and k before RoPE).
//   Backward: from dy [n, fused out] (activation dtype; RoPE already undone
//             for q and k), the adapter's own gradients, and dx [n, in]
//             (dx_dtype) += f's input gradient; dx is null where the engine
//             needs no input gradient (the first block of a frozen base).
//             Called right after the base's dx GEMM wrote dx.
class ProjectionAdapters {
 public:
  virtual ~ProjectionAdapters() = default;
  virtual Status Forward(const Blas& blas, int layer, Projection p, const void* x, int n, void* y,
                         DType y_dtype) = 0;
  virtual Status Backward(const Blas& blas, int layer, Projection p, const void* x, const void* dy, int n, void* dx,
                          DType dx_dtype) = 0;
};

struct LlamaEngineOptions {
  DType precision = DType::kF32;
  // f32 only: let cuBLAS round GEMM inputs to TF32 (faster, ~1e-3 relative).
  bool allow_tf32 = false;
  // f16 only.
  LossScalerOptions loss_scaler;
  // bf16/f16 with head_dim 64: attention without the seq x seq matrix
  // (flash_attention.h): on an H100 the 124M model's step takes 22.4 ms
  // against 34.3 on the materialised path, in 5.1 against 8.3 GiB of
  // activations. false takes the materialised path, as f32 and other head
  // sizes always do.
  bool flash_attention = true;
  // Run on this stream (owned by the caller, who keeps it alive) instead of
  // one of the engine's own: a data-parallel rank hands the same stream to its
  // NCCL communicator, whose collectives then follow this engine's kernels.
  cudaStream_t stream = nullptr;
  // false: the base is frozen (LoRA). No gradient buffer is allocated
  // (gradients() is null), backward forms no weight gradient (no dW GEMM, no
  // embedding or norm-weight gradient kept) and no input gradient of the
  // first block, and Step is refused: only the adapters train.
  bool train_base = true;
  // Owned by the caller, alive as long as the engine; see ProjectionAdapters.
  ProjectionAdapters* adapters = nullptr;
  // Activation recompute (models::Llama's): every block keeps only its input
  // (the residual stream); one set of block activations is shared, and
  // backward re-runs each block's forward up to the SwiGLU before its own
  // backward. The same kernels on the same inputs, so the same gradients,
  // for one more forward's GEMMs; activation_bytes() shrinks by L - 1 blocks.
  bool recompute = false;
};

// Beyond Engine: gradients() is null when the base is frozen (train_base
// false), and so are parameters() once the fp32 master is dropped
// (DropFp32Master), which parameter_bytes() then counts the norms' fp32 copy
// in. Initialize draws InitializeLlamaParameters's bits (models/llama.h), as
// models::Llama::Initialize. Step returns false when an f16 step was skipped
// for inf/NaN gradients (the loss scaler is updated either way); it, and
// CopyGradientsTo, are refused for a frozen base.
class LlamaEngine : public Engine {
 public:
  // Zero parameters (Initialize or CopyParametersFrom before training) and
  // activation memory for up to max_batch sequences of max_seq_len tokens.
  static Result<LlamaEngine> Create(const LlamaConfig& config, int max_batch, LlamaEngineOptions options = {});

  LlamaEngine(LlamaEngine&&) noexcept = default;
  LlamaEngine& operator=(LlamaEngine&&) noexcept = default;

  const LlamaConfig& config() const;
  // manifest() equals models::Llama's for the same config, and units() its units.
  int max_batch() const;
  // Bytes of the activation buffer allocated at Create.
  size_t activation_bytes() const;
  bool recompute() const;  // LlamaEngineOptions::recompute

  Status Initialize(uint64_t seed) override;

  // A frozen base (train_base false) under bf16/f16 may drop its fp32
  // master: the working copy then holds the weights, rounded to nearest even,
  // in 2 bytes each instead of 6. The GEMMs and the embedding lookup read it,
  // the norms an fp32 copy of their rounded weights, so the engine is exactly
  // one with an fp32 master that holds the rounded weights. parameters()
  // becomes null; CopyParametersFrom rounds, CopyParametersTo widens.
  // Refused (one line) for a base that trains or under f32.
  Status DropFp32Master();
  bool has_fp32_master() const;

  // tokens and targets are host arrays of [batch, seq] ids (targets[i] is the
  // token after tokens[i], or -100 for a target that scores nothing), checked
  // as models::Llama checks them. Overwrites gradients() (scaled by the loss
  // scale under f16) and leaves the mean cross-entropy over the scored
  // targets in device_loss() (0 when none scores), without waiting.
  Status ForwardBackwardAsync(const int32_t* tokens, const int32_t* targets, int batch, int seq);
  // With data-parallel options (models/step_hooks.h): the gradient formed is
  // that of options.grad_scale x the mean loss (times the f16 loss scale), and
  // options.hooks->GradientsFinal(offset) is called as each unit's backward
  // is enqueued, so a collective issued from it on a communicator that
  // follows stream() starts as soon as those kernels are done. BeforeUnit and
  // AfterUnit are not called (the parameters are never sharded on a GPU), and
  // accumulate is refused: every step overwrites the gradients.
  Status ForwardBackwardAsync(const int32_t* tokens, const int32_t* targets, int batch, int seq,
                              const BackwardOptions& options);
  // The same, then waits for the loss.
  Result<float> ForwardBackward(const int32_t* tokens, const int32_t* targets, int batch, int seq);
  // Writes logits [batch, seq, vocab] to host memory (waits).
  Status Forward(const int32_t* tokens, int batch, int seq, float* logits);

  // The f16 loss scaler (unused under f32 and bf16); settable so that a
  // resumed run continues with the saved scale.
  LossScaler& loss_scaler();

 private:
  // Cached generation (llama_decoder.h) runs this engine's weights with its ops.
  friend class LlamaDecoder;
  struct Impl;
  explicit LlamaEngine(std::unique_ptr<Impl> impl);
  Impl& impl() const;
};

}  // namespace estuary::models::cuda
