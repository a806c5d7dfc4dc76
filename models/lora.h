// LoRA adapters on the CPU LLaMA decoder (models/llama.h): the model side of
// federated LoRA fine-tuning.
//
// Each adapted projection W [out, in] (q, k, v, o and optionally gate, up,
// down) gains two factors, A [rank, in] and B [out, rank], and computes
//   y = x·Wᵀ + (alpha / rank) · dropout(x)·Aᵀ·Bᵀ
// as Hugging Face PEFT's LoraLayer does: dropout (inverted, p = lora_dropout)
// on the adapter's input only, one independent mask per module, in training
// steps only (Forward is inference, PEFT's eval mode). The masks are a hash
// of (dropout seed, step, layer, module, element), so a run is reproducible
// and a mask can be redrawn for backward instead of stored.
//
// The base model is frozen. A LoraLlama owns its base Llama and two flat
// buffers of its own: the adapter parameters and their gradients, of one
// layout whose manifest() names the tensors as PEFT saves them
// ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"), per
// layer and module in the order q, k, v, o, gate, up, down, lora_A before
// lora_B. Only that buffer is trained:
//   auto loss = lora.ForwardBackward(tokens, targets, batch, seq);  // fills gradients()
//   optimizer.Step(lora.parameters(), lora.gradients());
// Backward forms no gradient of a frozen weight: the base projections compute
// only their input gradient (no dW GEMM), the embedding's backward is skipped
// and the first block's input gradient is not formed. The base model's
// gradient buffer is never written.
//
// The fused q/k/v (and gate/up) GEMM of the base model is kept; the adapters
// are per projection and add into their column slice of the fused output.
// The step runs on the base model's activation arena (it is the base's
// forward with the adapters added in), plus a small arena of its own for the
// [n, rank] products x·Aᵀ kept for backward: a step allocates nothing.
// A base made with recompute (Llama::Create) recomputes here too: each block's
// forward, adapters and dropout masks included, is re-run before its
// backward, and the dropped inputs (dropout > 0) take one layer's room.
//
// Why a wrapper and not a flag inside Llama: the plain decoder's hot loop
// stays as it is (its results are pinned bit for bit), and the frozen
// backward, which differs in what it forms, reads top to bottom here.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "models/flat_buffer.h"
#include "models/llama.h"
#include "models/step_hooks.h"
#include "models/tensor.h"

namespace estuary::models {

// The projections an adapter can sit on, in buffer order within a block.
enum class LoraModule { kQ, kK, kV, kO, kGate, kUp, kDown };
inline constexpr int kLoraModules = 7;
// PEFT's target_modules names: "q_proj", ..., "down_proj".
std::string_view LoraModuleName(LoraModule module);

// What PEFT's LoraConfig calls r, lora_alpha, lora_dropout, target_modules.
struct LoraConfig {
  int rank = 8;
  float alpha = 16;
  float dropout = 0;  // lora_dropout, in [0, 1)
  std::vector<std::string> target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
  std::string base_model_name_or_path;  // written to adapter_config.json as is

  double scale() const { return double(alpha) / double(rank); }
  bool Targets(LoraModule module) const;
  // rank positive, alpha positive and finite, dropout in [0, 1), target_modules a
  // non-empty list of distinct names from the seven above.
  Status Validate() const;
};

// One adapted projection: pointers into the adapter buffers.
struct LoraLinear {
  int in = 0, out = 0, rank = 0;
  float scale = 0;  // alpha / rank
  float *a = nullptr, *b = nullptr, *da = nullptr, *db = nullptr;

  // y[n, out] (rows ldy apart, so a slice of a fused output) += scale · xa·Bᵀ
  // with xa [n, rank] = x·Aᵀ, kept for backward.
  void Forward(const float* x, int n, float* xa, float* y, int64_t ldy) const;
  // From dy [n, out] (rows ldy apart): dB = scale · dyᵀ·xa, dA = tᵀ·x with
  // t [n, rank] = scale · dy·B (scratch), and dx += t·A when dx is not null.
  // dA and dB are overwritten, or added to with accumulate.
  void Backward(const float* x, const float* xa, const float* dy, int64_t ldy, int n, float* t, float* dx,
                bool accumulate) const;
};

// Where the adapters of a decoder live in the adapter buffer: the manifest
// (PEFT's names; per layer and module in the order q, k, v, o, gate, up,
// down, lora_A before lora_B) and, per layer and module, A's and B's offsets
// (elements) with the projection's (in, out). The CPU LoraLlama and the GPU
// cuda::LoraLlamaEngine both lay out their buffers from this, so adapter
// buffers copy one to one between them.
struct LoraLayout {
  struct Adapter {
    bool present = false;  // false: the module is not targeted
    int in = 0, out = 0, rank = 0;
    uint64_t a = 0, b = 0;
  };
  Manifest manifest;
  std::vector<std::array<Adapter, kLoraModules>> layers;
  // models/step_hooks.h's units: one per layer (the layout is layer-major),
  // from its first adapter to the next layer's.
  std::vector<ParameterUnit> units;
};
// `config` must be valid (LoraConfig::Validate), `base` too.
LoraLayout LoraLayoutOf(const LlamaConfig& base, const LoraConfig& config);

// PEFT's default init into a buffer of layout.manifest.total_elements floats:
// B = 0 and A uniform(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform_, a = sqrt(5)),
// drawn in layout order from one generator seeded with `seed`. LoraLlama's and
// the GPU engine's Initialize both call it: the same seed, the same bits.
void InitializeLoraAdapters(const LoraLayout& layout, uint64_t seed, std::span<float> params);

class LoraLlama {
 public:
  // Adapters on `base` (its weights as they are; A and B zero until
  // Initialize or a load), for batches up to base.max_batch(). Fails on an
  // invalid config.
  static Result<LoraLlama> Create(Llama base, const LoraConfig& config);

  LoraLlama(LoraLlama&&) = default;
  LoraLlama& operator=(LoraLlama&&) = default;
  LoraLlama(const LoraLlama&) = delete;  // the adapters point into this object's buffers
  LoraLlama& operator=(const LoraLlama&) = delete;

  const LoraConfig& lora_config() const { return lora_config_; }
  const Llama& base() const { return base_; }
  // Writable to load or replace base weights; training never changes them.
  // With a bf16 base, load through LoadBase instead.
  Llama& base() { return base_; }

  // Keeps the frozen base in bf16 from now on: 2 bytes a weight instead of 4.
  // The base's current weights are rounded to bf16 (to nearest even) and its
  // fp32 buffer gives its pages back; each step then unpacks one unit of it
  // at a time (a block, the final norm and head; the embedding lookup reads
  // its rows straight from bf16) just before the unit is used and releases
  // it after, so about one unit's fp32 weights are resident (at the turn from
  // forward to backward, the last block's and the head's). The model computes in fp32 with the bf16-rounded
  // base: bit for bit what an fp32 base holding those rounded weights gives.
  void StoreBaseInBf16();
  bool base_in_bf16() const { return !base_bf16_.empty(); }
  // Replaces the base's weights (base().parameters()'s layout); rounded to
  // bf16 when the base is kept so.
  Status LoadBase(std::span<const float> weights);

  // The adapter buffers (PEFT names, see above).
  const Manifest& manifest() const { return layout_.manifest; }
  std::span<float> parameters() { return params_; }
  std::span<const float> parameters() const { return params_; }
  std::span<float> gradients() { return grads_; }
  std::span<const float> gradients() const { return grads_; }
  // The adapter buffer's units (models/step_hooks.h): one per layer, its
  // adapters' A and B.
  std::vector<ParameterUnit> units() const { return layout_.units; }

  // PEFT's default init: B = 0, and A by nn.init.kaiming_uniform_(A, a=√5),
  // which is uniform(-1/√in, 1/√in); from one generator seeded with `seed`.
  // So the adapted model starts equal to the base.
  void Initialize(uint64_t seed);

  // Dropout masks from now on are those of (seed, step 0, 1, ...): each
  // ForwardBackward advances the step. A new model has seed 0 at step 0.
  void SeedDropout(uint64_t seed) {
    dropout_seed_ = seed;
    dropout_step_ = 0;
  }
  // The next batches' token rows are rows first_row, first_row + 1, ... of a
  // larger batch (0 by default): they draw that batch's masks. So ranks that
  // each compute a share of a batch drop what one process would.
  void SetDropoutFirstRow(int64_t first_row) { dropout_first_row_ = first_row; }

  // As Llama's, with the same checks and ignored (-100) targets; fills
  // gradients() (overwrites, or adds with accumulate; grad_scale as there).
  // With hooks, GradientsFinal
  // reports each layer's adapters as their backward completes, so DDP and
  // ZeRO-1/2 reduce the adapter buffer while backward goes on. BeforeUnit and
  // AfterUnit are not called: ZeRO-3, which needs them to gather parameters,
  // does not apply (DataParallel refuses a model that never brackets).
  Result<float> ForwardBackward(const int32_t* tokens, const int32_t* targets, int batch, int seq,
                                const BackwardOptions& options = {});
  // Writes logits [batch, seq, vocab_size] of the adapted model (no dropout).
  Status Forward(const int32_t* tokens, int batch, int seq, float* logits);

  // The base with every adapter folded in, W' = W + (alpha/rank)·B·A: a plain
  // Llama (arena for max_batch) with the adapted model's outputs.
  Result<Llama> Merged(int max_batch = 1) const;

 private:
  LoraLlama(Llama base, const LoraConfig& config);
  // A bf16 base's unit `unit` (base().units()): unpacked into the base's
  // fp32 buffer before use, its pages released after. No-ops for an fp32 base.
  void OpenBase(int unit);
  void CloseBase(int unit);
  // With train and dropout > 0, each adapter reads its dropped input.
  void RunForward(const int32_t* tokens, int batch, int seq, float* logits, bool train);
  // Block l's forward with its adapters, as Llama::ForwardBlock; without
  // to_output it stops after the SwiGLU (and the down adapter's dropout),
  // which is what backward's recomputation needs.
  void ForwardBlock(int l, int batch, int seq, bool train, bool to_output);
  // dropout(x) for module m of layer l, written to Dropped(l, m) and returned.
  const float* Drop(int l, LoraModule m, const float* x, int n);
  // The dropout mask of module m in layer l this step: element i is kept
  // when a uniform draw from SplitMix64(stream + i) is at least p.
  uint64_t MaskStream(int layer, LoraModule m) const;
  // dropout(x) of module m in layer l, kept for backward: [max rows, in].
  float* Dropped(int layer, LoraModule m) { return xd_.data() + xd_at_[size_t(layer) * kLoraModules + size_t(m)]; }
  // x·Aᵀ of module m in layer l, kept for backward: [max rows, rank].
  float* Xa(int layer, LoraModule m) {
    return xa_.data() + (size_t(layer) * kLoraModules + size_t(m)) * size_t(xa_rows_) * size_t(lora_config_.rank);
  }

  Llama base_;
  LoraConfig lora_config_;
  LoraLayout layout_;  // its manifest is manifest()
  FlatBuffer<float> params_, grads_;
  std::vector<std::array<LoraLinear, kLoraModules>> layers_;  // a == nullptr: not adapted
  int64_t xa_rows_ = 0;
  std::vector<float> xa_, t_, dnorm_;  // kept products, backward scratch [rows, rank], frozen norms' dw [D]
  // With dropout only: the dropped inputs (offsets per layer and module), and
  // [rows, max in] scratch for the adapter's input gradient before the mask.
  std::vector<float> xd_, dxd_;
  std::vector<size_t> xd_at_;
  uint64_t dropout_seed_ = 0, dropout_step_ = 0;
  int64_t dropout_first_row_ = 0;
  std::vector<uint16_t> base_bf16_;  // the base, when kept in bf16
};

// A PEFT adapter directory: adapter_model.safetensors (fp32, manifest()'s
// names and shapes, metadata format "pt") and adapter_config.json (peft_type
// LORA, task_type CAUSAL_LM, r, lora_alpha, lora_dropout, target_modules,
// bias "none", base_model_name_or_path), each written atomically; the
// directory is created if needed.
Status SaveLoraAdapter(const std::filesystem::path& dir, const LoraLlama& model);

// Reads dir/adapter_config.json. Rejects what this implementation does not
// do (bias other than "none", use_dora, use_rslora, fan_in_fan_out, a regex
// target_modules, a per-module rank or alpha pattern), naming the key.
Result<LoraConfig> ReadLoraConfig(const std::filesystem::path& dir);

// Loads such a directory's adapters into `model`. Its adapter_config.json must
// describe model's adapters (rank, alpha, targets; dropout may differ); every tensor's
// name, shape and dtype is checked, and the first mismatch is reported, in one
// line, with the file and the tensor's name. On error the model is untouched.
Status LoadLoraAdapter(const std::filesystem::path& dir, LoraLlama& model);

// model.Merged() written as a Hugging Face model directory (SaveHfCheckpoint).
Status SaveMergedHfCheckpoint(const std::filesystem::path& dir, const LoraLlama& model);

}  // namespace estuary::models
