// LlamaEngine's training step (llama_engine.h): the ids checked and uploaded,
// then the decoder's forward and backward passes on the engine's stream.
#include <cmath>
#include <cstring>

#include "models/cuda/check.h"
#include "models/cuda/flash_attention.h"
#include "models/cuda/llama_engine_impl.h"
#include "models/transformer_ops.h"

namespace estuary::models::cuda {

Status LlamaEngine::Impl::CheckInput(const int32_t* tokens, const int32_t* targets, int batch, int seq) const {
  if (batch < 1 || batch > max_batch) {
    return InvalidArgument("cuda llama: batch {} is outside [1, {}] (max_batch given at Create)", batch, max_batch);
  }
  if (seq < 1 || seq > config.max_seq_len) {
    return InvalidArgument("cuda llama: sequence length {} is outside [1, {}] (max_seq_len)", seq,
                           config.max_seq_len);
  }
  auto check = [&](const char* what, const int32_t* ids) -> Status {
    for (int64_t i = 0; i < int64_t(batch) * seq; ++i) {
      if (targets == ids && ids[i] == kIgnoredTarget) continue;  // scores nothing
      if (ids[i] < 0 || ids[i] >= config.vocab_size) {
        return InvalidArgument("cuda llama: {} id {} at batch {}, position {} is outside the vocabulary [0, {})",
                               what, ids[i], i / seq, i % seq, config.vocab_size);
      }
    }
    return Status::Ok();
  };
  if (!tokens) return InvalidArgument("cuda llama: no token ids given");
  ESTUARY_RETURN_IF_ERROR(check("token", tokens));
  if (targets) ESTUARY_RETURN_IF_ERROR(check("target", targets));
  return Status::Ok();
}

Status LlamaEngine::Impl::Upload(const int32_t* tokens, const int32_t* targets, int batch, int seq) {
  const int64_t n = int64_t(batch) * seq, max_n = int64_t(max_batch) * config.max_seq_len;
  // The previous upload must have left the staging buffer before it is refilled.
  if (staging_used) ESTUARY_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(staging_free.get()));
  std::memcpy(staging.as<int32_t>(), tokens, size_t(n) * sizeof(int32_t));
  if (targets) std::memcpy(staging.as<int32_t>() + max_n, targets, size_t(n) * sizeof(int32_t));
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tokens_d(), staging.as<int32_t>(), size_t(n) * sizeof(int32_t),
                                               cudaMemcpyHostToDevice, s()));
  if (targets) {
    ESTUARY_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(targets_d(), staging.as<int32_t>() + max_n, size_t(n) * sizeof(int32_t),
                                                 cudaMemcpyHostToDevice, s()));
  }
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaEventRecord(staging_free.get(), s()));
  staging_used = true;
  return Status::Ok();
}

Status LlamaEngine::Impl::ForwardBlock(int l, int batch, int seq, bool through_down) {
  const LlamaConfig& c = config;
  const int n = batch * seq, D = c.hidden_size, I = c.intermediate_size, hd = c.head_dim();
  const int H = c.num_heads, KV = c.num_kv_heads;
  const int64_t qkv_width = int64_t(H + 2 * KV) * hd;
  const float eps = float(c.rms_norm_eps);
  const LayerOffsets& o = offsets[l];
  const LayerActivations& a = acts.layers[l];
  const float* x = acts.resid + l * acts.resid_stride;
  ESTUARY_RETURN_IF_ERROR(RmsNormForward(x, Norm(o.input_norm), n, D, eps, a.xn1, act(), a.rstd1, s()));
  ESTUARY_RETURN_IF_ERROR(
      Gemm(blas, false, true, n, qkv_width, D, 1.0f, a.xn1, D, W(o.qkv), D, 0.0f, a.qkv, qkv_width, Same()));
  ESTUARY_RETURN_IF_ERROR(AdaptForward(l, Projection::kQkv, a.xn1, n, a.qkv, act()));
  // q and k heads are adjacent at the start of each row: one rotation for both.
  ESTUARY_RETURN_IF_ERROR(RopeForward(a.qkv, act(), batch, seq, H + KV, hd, qkv_width, rope_cos(), rope_sin(), s()));
  if (flash) {
    ESTUARY_RETURN_IF_ERROR(FlashAttentionForward(act(), a.qkv, batch, seq, H, KV, hd, a.attn, a.lse, s()));
  } else {
    float* scores = low() ? acts.scores : static_cast<float*>(a.probs);
    ESTUARY_RETURN_IF_ERROR(AttentionForward(blas, act(), a.qkv, batch, seq, H, KV, hd, scores, a.probs, a.attn));
  }
  ESTUARY_RETURN_IF_ERROR(Gemm(blas, false, true, n, D, int64_t(H) * hd, 1.0f, a.attn, int64_t(H) * hd, W(o.o),
                               int64_t(H) * hd, 0.0f, a.h, D, ToF32()));
  ESTUARY_RETURN_IF_ERROR(AdaptForward(l, Projection::kO, a.attn, n, a.h, DType::kF32));
  ESTUARY_RETURN_IF_ERROR(ResidualAdd(x, int64_t(n) * D, a.h, s()));
  ESTUARY_RETURN_IF_ERROR(RmsNormForward(a.h, Norm(o.post_norm), n, D, eps, a.xn2, act(), a.rstd2, s()));
  ESTUARY_RETURN_IF_ERROR(
      Gemm(blas, false, true, n, 2 * int64_t(I), D, 1.0f, a.xn2, D, W(o.gate_up), D, 0.0f, a.gate_up, 2 * I, Same()));
  ESTUARY_RETURN_IF_ERROR(AdaptForward(l, Projection::kGateUp, a.xn2, n, a.gate_up, act()));
  ESTUARY_RETURN_IF_ERROR(SwiGluForward(a.gate_up, n, I, a.act, act(), s()));
  if (!through_down) return Status::Ok();
  float* out = acts.resid + (l + 1) * acts.resid_stride;
  ESTUARY_RETURN_IF_ERROR(Gemm(blas, false, true, n, D, I, 1.0f, a.act, I, W(o.down), I, 0.0f, out, D, ToF32()));
  ESTUARY_RETURN_IF_ERROR(AdaptForward(l, Projection::kDown, a.act, n, out, DType::kF32));
  return ResidualAdd(a.h, int64_t(n) * D, out, s());
}

Status LlamaEngine::Impl::RunForward(int batch, int seq) {
  const LlamaConfig& c = config;
  const int n = batch * seq, D = c.hidden_size, V = c.vocab_size;
  Carve(batch, seq, activation_buffer.as<char>());
  ESTUARY_RETURN_IF_ERROR(Embed(n, acts.resid));
  for (int l = 0; l < c.num_layers; ++l) ESTUARY_RETURN_IF_ERROR(ForwardBlock(l, batch, seq, /*through_down=*/true));
  ESTUARY_RETURN_IF_ERROR(RmsNormForward(acts.resid + c.num_layers * acts.resid_stride, Norm(final_norm), n, D,
                                         float(c.rms_norm_eps), acts.xn_final, act(), acts.rstd_final, s()));
  return Gemm(blas, false, true, n, V, D, 1.0f, acts.xn_final, D, W(lm_head), D, 0.0f, acts.logits, V, ToF32());
}

Status LlamaEngine::Impl::RunBackward(int batch, int seq, const BackwardOptions& options) {
  StepHooks& hooks = options.hooks ? *options.hooks : StepHooks::None();
  const int final_unit = int(units.size()) - 1;
  const LlamaConfig& c = config;
  const int n = batch * seq, D = c.hidden_size, I = c.intermediate_size, hd = c.head_dim(), V = c.vocab_size;
  const int H = c.num_heads, KV = c.num_kv_heads;
  const int64_t qkv_width = int64_t(H + 2 * KV) * hd, attn_width = int64_t(H) * hd;
  const Activations& a = acts;
  // A frozen base forms no weight gradient: each projection computes only its
  // input gradient (one GEMM instead of two).
  const bool train = !frozen();
  const float grad_scale = options.grad_scale * (act() == DType::kF16 ? scaler.scale() : 1.0f);
  ESTUARY_RETURN_IF_ERROR(CrossEntropyForwardBackward(a.logits, targets_d(), n, V, a.dlogits, act(), grad_scale,
                                                      loss_d(), Scratch(), s()));
  // The LM head first: when tied it writes the embedding's gradient, to which
  // the input side is added last.
  if (train) {
    ESTUARY_RETURN_IF_ERROR(
        Gemm(blas, true, false, V, D, n, 1.0f, a.dlogits, V, a.xn_final, D, 0.0f, G() + lm_head, D, ToF32()));
  }
  ESTUARY_RETURN_IF_ERROR(Gemm(blas, false, false, n, D, V, 1.0f, a.dlogits, V, W(lm_head), D, 0.0f, a.dxn, D, ToF32()));
  ESTUARY_RETURN_IF_ERROR(FillBytes(a.dresid, 0, size_t(n) * D * sizeof(float), s()));
  // dresid holds dL/d(output of block l) on entry and dL/d(its input) on exit;
  // under bf16/f16 every norm backward also leaves its low-precision copy,
  // which the next GEMMs read.
  ESTUARY_RETURN_IF_ERROR(RmsNormBackward(a.resid + c.num_layers * a.resid_stride, Norm(final_norm), a.rstd_final,
                                          a.dxn, n, D, a.dresid, NormGrad(final_norm), Scratch(), s(), a.dresid_low,
                                          act()));
  // Untied, the final unit (norm and LM head) is done; tied, the embedding's
  // gradient still waits for the lookup's share, but the final norm is done.
  hooks.GradientsFinal(units[final_unit].begin);
  const void* dres = low() ? a.dresid_low : static_cast<const void*>(a.dresid);
  for (int l = c.num_layers - 1; l >= 0; --l) {
    const LayerOffsets& o = offsets[l];
    const LayerActivations& L = a.layers[l];
    // The shared set still holds the last block's activations from forward.
    if (this->options.recompute && l != c.num_layers - 1) {
      ESTUARY_RETURN_IF_ERROR(ForwardBlock(l, batch, seq, /*through_down=*/false));
    }
    if (train) {
      ESTUARY_RETURN_IF_ERROR(Gemm(blas, true, false, D, I, n, 1.0f, dres, D, L.act, I, 0.0f, G() + o.down, I, ToF32()));
    }
    ESTUARY_RETURN_IF_ERROR(Gemm(blas, false, false, n, I, D, 1.0f, dres, D, W(o.down), I, 0.0f, a.dact, I, Same()));
    ESTUARY_RETURN_IF_ERROR(AdaptBackward(l, Projection::kDown, L.act, dres, n, a.dact, act()));
    ESTUARY_RETURN_IF_ERROR(SwiGluBackward(L.gate_up, a.dact, n, I, a.dgate_up, act(), s()));
    if (train) {
      ESTUARY_RETURN_IF_ERROR(Gemm(blas, true, false, 2 * int64_t(I), D, n, 1.0f, a.dgate_up, 2 * I, L.xn2, D, 0.0f,
                                   G() + o.gate_up, D, ToF32()));
    }
    ESTUARY_RETURN_IF_ERROR(
        Gemm(blas, false, false, n, D, 2 * int64_t(I), 1.0f, a.dgate_up, 2 * I, W(o.gate_up), D, 0.0f, a.dxn, D,
             ToF32()));
    ESTUARY_RETURN_IF_ERROR(AdaptBackward(l, Projection::kGateUp, L.xn2, a.dgate_up, n, a.dxn, DType::kF32));
    ESTUARY_RETURN_IF_ERROR(RmsNormBackward(L.h, Norm(o.post_norm), L.rstd2, a.dxn, n, D, a.dresid,
                                            NormGrad(o.post_norm), Scratch(), s(), a.dresid_low, act()));
    if (train) {
      ESTUARY_RETURN_IF_ERROR(
          Gemm(blas, true, false, D, attn_width, n, 1.0f, dres, D, L.attn, attn_width, 0.0f, G() + o.o, attn_width,
               ToF32()));
    }
    ESTUARY_RETURN_IF_ERROR(
        Gemm(blas, false, false, n, attn_width, D, 1.0f, dres, D, W(o.o), attn_width, 0.0f, a.dattn, attn_width,
             Same()));
    ESTUARY_RETURN_IF_ERROR(AdaptBackward(l, Projection::kO, L.attn, dres, n, a.dattn, act()));
    if (flash) {
      ESTUARY_RETURN_IF_ERROR(FlashAttentionBackward(act(), L.qkv, L.attn, a.dattn, L.lse, batch, seq, H, KV, hd,
                                                     a.delta, a.dqkv, s()));
    } else {
      ESTUARY_RETURN_IF_ERROR(AttentionBackward(blas, act(), L.qkv, L.probs, a.dattn, batch, seq, H, KV, hd,
                                                a.dprobs, a.dscores, a.dqkv));
    }
    ESTUARY_RETURN_IF_ERROR(
        RopeBackward(a.dqkv, act(), batch, seq, H + KV, hd, qkv_width, rope_cos(), rope_sin(), s()));
    if (train) {
      ESTUARY_RETURN_IF_ERROR(Gemm(blas, true, false, qkv_width, D, n, 1.0f, a.dqkv, qkv_width, L.xn1, D, 0.0f,
                                   G() + o.qkv, D, ToF32()));
    }
    // The first block's input is the (frozen) embedding: with nothing to
    // train below it, a frozen base needs no input gradient there.
    const bool need_dx = train || l > 0;
    if (need_dx) {
      ESTUARY_RETURN_IF_ERROR(
          Gemm(blas, false, false, n, D, qkv_width, 1.0f, a.dqkv, qkv_width, W(o.qkv), D, 0.0f, a.dxn, D, ToF32()));
    }
    ESTUARY_RETURN_IF_ERROR(
        AdaptBackward(l, Projection::kQkv, L.xn1, a.dqkv, n, need_dx ? a.dxn : nullptr, DType::kF32));
    if (need_dx) {
      ESTUARY_RETURN_IF_ERROR(RmsNormBackward(a.resid + l * a.resid_stride, Norm(o.input_norm), L.rstd1, a.dxn, n, D,
                                              a.dresid, NormGrad(o.input_norm), Scratch(), s(), a.dresid_low, act()));
    }
    hooks.GradientsFinal(units[1 + l].begin);
  }
  if (!train) return Status::Ok();
  if (!c.tie_embeddings) {
    ESTUARY_RETURN_IF_ERROR(FillBytes(G() + embed, 0, size_t(V) * D * sizeof(float), s()));
  }
  ESTUARY_RETURN_IF_ERROR(EmbeddingBackward(tokens_d(), n, a.dresid, V, D, G() + embed, Scratch(), s()));
  hooks.GradientsFinal(0);
  return Status::Ok();
}

Status LlamaEngine::ForwardBackwardAsync(const int32_t* tokens, const int32_t* targets, int batch, int seq) {
  return ForwardBackwardAsync(tokens, targets, batch, seq, BackwardOptions{});
}

Status LlamaEngine::ForwardBackwardAsync(const int32_t* tokens, const int32_t* targets, int batch, int seq,
                                         const BackwardOptions& options) {
  Impl& m = impl();
  if (!targets) return InvalidArgument("cuda llama: no target ids given");
  ESTUARY_RETURN_IF_ERROR(m.CheckBackwardOptions(options));
  if (options.hooks && m.frozen()) {
    return InvalidArgument("cuda llama: step hooks (DDP, ZeRO) over a frozen base are not supported: it has no "
                           "gradient buffer to reduce");
  }
  ESTUARY_RETURN_IF_ERROR(m.CheckInput(tokens, targets, batch, seq));
  ESTUARY_RETURN_IF_ERROR(m.Upload(tokens, targets, batch, seq));
  ESTUARY_RETURN_IF_ERROR(m.RunForward(batch, seq));
  return m.RunBackward(batch, seq, options);
}

Result<float> LlamaEngine::ForwardBackward(const int32_t* tokens, const int32_t* targets, int batch, int seq) {
  ESTUARY_RETURN_IF_ERROR(ForwardBackwardAsync(tokens, targets, batch, seq));
  return ReadLoss();
}

Status LlamaEngine::Forward(const int32_t* tokens, int batch, int seq, float* logits) {
  Impl& m = impl();
  ESTUARY_RETURN_IF_ERROR(m.CheckInput(tokens, nullptr, batch, seq));
  if (!logits) return InvalidArgument("cuda llama: no logits buffer given");
  ESTUARY_RETURN_IF_ERROR(m.Upload(tokens, nullptr, batch, seq));
  ESTUARY_RETURN_IF_ERROR(m.RunForward(batch, seq));
  return CopyToHost(logits, m.acts.logits, size_t(batch) * seq * m.config.vocab_size * sizeof(float), m.s());
}

}  // namespace estuary::models::cuda
