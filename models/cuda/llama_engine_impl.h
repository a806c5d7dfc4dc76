// LlamaEngine's Impl (internal to llama_engine.cc, which creates the engine
// and holds its parameters, and llama_engine_passes.cc, which runs its
// training step): the decoder's layout, buffers and activations.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "models/cuda/blas.h"
#include "models/cuda/device.h"
#include "models/cuda/engine_state.h"
#include "models/cuda/llama_engine.h"
#include "models/cuda/transformer.h"

namespace estuary::models::cuda {

// The flat buffers, the stream and the manifest are the EngineState's; the
// stream, a base class member, outlives blas.
struct LlamaEngine::Impl final : EngineState {
  using LayerOffsets = LlamaLayout::Layer;

  // What one block keeps for backward (n = batch * seq rows); `void*` buffers
  // hold the activation dtype.
  struct LayerActivations {
    float* rstd1 = nullptr;
    void* xn1 = nullptr;    // [n, D]
    void* qkv = nullptr;    // [n, (H + 2 KV) hd], after RoPE
    void* probs = nullptr;  // [batch, H, seq, seq]; null with flash attention
    float* lse = nullptr;   // [batch, H, seq]: flash attention's softmax statistics
    void* attn = nullptr;   // [n, H hd]
    float* h = nullptr;     // residual stream after attention [n, D]
    float* rstd2 = nullptr;
    void* xn2 = nullptr;      // [n, D]
    void* gate_up = nullptr;  // [n, 2 I]
    void* act = nullptr;      // [n, I]
  };

  struct Activations {
    float* resid = nullptr;  // num_layers + 1 blocks of [n, D]
    int64_t resid_stride = 0;
    std::vector<LayerActivations> layers;  // under recompute all alias one set
    float* rstd_final = nullptr;
    void* xn_final = nullptr;
    float* logits = nullptr;   // [n, V] fp32
    void* dlogits = nullptr;   // [n, V]; the logits themselves under f32
    float* scores = nullptr;   // [batch, H, seq, seq] fp32 scratch; null under f32 (each layer's probs serve)
    float* dprobs = nullptr;   // [batch, H, seq, seq] fp32
    void* dscores = nullptr;   // the same in the activation dtype; dprobs under f32
    float* delta = nullptr;    // [batch, H, seq]: flash attention's backward scratch
    // With flash attention, scores, dprobs and dscores are null: no seq x seq buffer exists.
    float* dresid = nullptr;   // [n, D] fp32
    void* dresid_low = nullptr;  // its low-precision copy; null under f32
    float* dxn = nullptr;        // [n, D] fp32 (GEMM outputs feeding the norms' backward)
    void *dqkv = nullptr, *dattn = nullptr, *dgate_up = nullptr, *dact = nullptr;
  };

  LlamaConfig config;
  LlamaEngineOptions options;
  int max_batch = 0;
  std::vector<LayerOffsets> offsets;
  uint64_t embed = 0, final_norm = 0, lm_head = 0;

  Blas blas;
  DeviceBuffer rope, ids, misc, activation_buffer;
  // Frozen base only: where the norms' weight gradients go, overwritten and
  // never read (the backward kernel forms dx and dweight in one pass; a
  // variant without dweight would save only a [D] reduction per norm).
  DeviceBuffer frozen_dnorm;
  // Without an fp32 master (DropFp32Master): the norms' weights widened from
  // the working copy, and where each norm's flat offset sits in that buffer.
  DeviceBuffer norms;
  struct NormSlot {
    uint64_t offset, count;  // in the flat buffer
    uint64_t slot;           // where it starts in `norms`
  };
  std::vector<NormSlot> norm_slots;  // ascending offsets
  Arena scratch;  // per-op scratch (norm partials, sort, row losses, clip), reset before each op
  PinnedBuffer staging;
  Event staging_free;  // recorded after the staging buffer's upload
  bool staging_used = false;
  Activations acts;
  LossScaler scaler;

  // Fused attention (flash_attention.h) when asked for and compiled for the
  // shape; the materialised path otherwise, and always under f32.
  bool flash = false;
  bool frozen() const { return !options.train_base; }
  // Where a norm's weight gradient goes: its slot in the gradient buffer, or
  // the discarded scratch when the base is frozen.
  float* NormGrad(uint64_t offset) const { return frozen() ? frozen_dnorm.as<float>() : G() + offset; }
  Status AdaptForward(int layer, Projection p, const void* x, int n, void* y, DType y_dtype) {
    return options.adapters ? options.adapters->Forward(blas, layer, p, x, n, y, y_dtype) : Status::Ok();
  }
  Status AdaptBackward(int layer, Projection p, const void* x, const void* dy, int n, void* dx, DType dx_dtype) {
    return options.adapters ? options.adapters->Backward(blas, layer, p, x, dy, n, dx, dx_dtype) : Status::Ok();
  }
  bool master() const { return params.data() != nullptr; }
  // A norm's fp32 weight: in the master, or in its copy when there is none.
  const float* Norm(uint64_t offset) const {
    if (master()) return P() + offset;
    const auto it = std::lower_bound(norm_slots.begin(), norm_slots.end(), offset,
                                     [](const NormSlot& n, uint64_t at) { return n.offset < at; });
    return norms.as<float>() + it->slot;
  }
  // The embedding table the lookup reads: the master's, else the working copy's.
  Status Embed(int n, float* out) const {
    if (master()) return EmbeddingForward(tokens_d(), n, P() + embed, config.vocab_size, config.hidden_size, out, s());
    return EmbeddingForward(tokens_d(), n, W(embed), act(), config.vocab_size, config.hidden_size, out, s());
  }
  // Rewrites the norms' fp32 copy from the working copy (no master).
  Status WidenNorms() const;
  // A device buffer for host <-> working-copy transfers without a master.
  Result<DeviceBuffer> ConversionChunk() const;
  const float* rope_cos() const { return rope.as<float>(); }
  const float* rope_sin() const { return rope.as<float>() + int64_t(config.max_seq_len) * (config.head_dim() / 2); }
  int32_t* tokens_d() const { return ids.as<int32_t>(); }
  int32_t* targets_d() const { return ids.as<int32_t>() + int64_t(max_batch) * config.max_seq_len; }
  float* loss_d() const { return misc.as<float>(); }
  float* found_inf_d() const { return misc.as<float>() + 1; }
  double* norm_d() const { return reinterpret_cast<double*>(misc.as<char>() + 256); }
  GemmTypes Same() const { return {act(), act(), options.allow_tf32 && !low()}; }
  GemmTypes ToF32() const { return {act(), DType::kF32, options.allow_tf32 && !low()}; }
  Arena& Scratch() {
    scratch.Reset();  // safe: every user of the scratch is on this stream, in order
    return scratch;
  }

  // Engine's hooks: without a master the weights go through the working
  // copy; a frozen base neither steps nor has gradients; f16 unscales first.
  Status UploadParameters(std::span<const float> host) override;
  Status DownloadParameters(std::span<float> host) override;
  size_t ParameterBytes() const override { return params.size() + working.size() + norms.size(); }
  Status CanStep() const override {
    if (!frozen()) return Status::Ok();
    return FailedPrecondition("cuda llama: the base is frozen (train_base false); step the adapters' optimizer instead");
  }
  Status HasGradients() const override {
    if (!frozen()) return Status::Ok();
    return FailedPrecondition("cuda llama: the base is frozen (train_base false): it has no gradients");
  }
  Result<bool> UnscaleGradients() override;

  void BuildManifest();
  size_t Carve(int batch, int seq, char* base);
  Status CheckInput(const int32_t* tokens, const int32_t* targets, int batch, int seq) const;
  Status Upload(const int32_t* tokens, const int32_t* targets, int batch, int seq);
  Status RunForward(int batch, int seq);
  // Block l's forward from its input resid[l]: into resid[l + 1] with
  // through_down, else only up to the SwiGLU output (what backward reads;
  // recompute's pass).
  Status ForwardBlock(int l, int batch, int seq, bool through_down);
  Status RunBackward(int batch, int seq, const BackwardOptions& options);
};

}  // namespace estuary::models::cuda
