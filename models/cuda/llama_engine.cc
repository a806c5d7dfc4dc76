#include "models/cuda/llama_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>

#include "models/cuda/check.h"
#include "models/cuda/engine_state.h"
#include "models/cuda/flash_attention.h"
#include "models/cuda/precision.h"
#include "models/cuda/transformer.h"

namespace estuary::models::cuda {
namespace {

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
  std::vector<LayerActivations> layers;
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

}  // namespace

// The flat buffers, the stream and the manifest are the EngineState's; the
// stream, a base class member, outlives blas.
struct LlamaEngine::Impl final : EngineState {
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
  Status RunBackward(int batch, int seq, const BackwardOptions& options);
};

// The layout of models::Llama, from the same LayoutOf.
void LlamaEngine::Impl::BuildManifest() {
  LlamaLayout layout = LayoutOf(config);
  manifest = std::move(layout.manifest);
  offsets = std::move(layout.layers);
  embed = layout.embed;
  final_norm = layout.final_norm;
  lm_head = layout.lm_head;
  units = std::move(layout.units);
}

size_t LlamaEngine::Impl::Carve(int batch, int seq, char* base) {
  const LlamaConfig& c = config;
  const int64_t n = int64_t(batch) * seq, D = c.hidden_size, V = c.vocab_size, I = c.intermediate_size;
  const int64_t hd = c.head_dim(), H = c.num_heads, KV = c.num_kv_heads;
  const int64_t qkv = n * (H + 2 * KV) * hd, square = int64_t(batch) * H * seq * seq;
  const size_t a = DTypeSize(act());
  Carver carver(base);
  acts.resid_stride = (n * D + 63) / 64 * 64;  // keeps every block 256-byte aligned
  acts.resid = carver.Floats(acts.resid_stride * (c.num_layers + 1));
  acts.layers.resize(c.num_layers);
  for (LayerActivations& l : acts.layers) {
    l.rstd1 = carver.Floats(n);
    l.xn1 = carver.Take(n * D, a);
    l.qkv = carver.Take(qkv, a);
    if (flash) {
      l.lse = carver.Floats(int64_t(batch) * H * seq);
    } else {
      l.probs = carver.Take(square, a);
    }
    l.attn = carver.Take(n * H * hd, a);
    l.h = carver.Floats(n * D);
    l.rstd2 = carver.Floats(n);
    l.xn2 = carver.Take(n * D, a);
    l.gate_up = carver.Take(n * 2 * I, a);
    l.act = carver.Take(n * I, a);
  }
  acts.rstd_final = carver.Floats(n);
  acts.xn_final = carver.Take(n * D, a);
  acts.logits = carver.Floats(n * V);
  acts.dlogits = low() ? carver.Take(n * V, a) : static_cast<void*>(acts.logits);
  if (flash) {
    acts.delta = carver.Floats(int64_t(batch) * H * seq);
  } else {
    acts.scores = low() ? carver.Floats(square) : nullptr;
    acts.dprobs = carver.Floats(square);
    acts.dscores = low() ? carver.Take(square, a) : static_cast<void*>(acts.dprobs);
  }
  acts.dresid = carver.Floats(n * D);
  acts.dresid_low = low() ? carver.Take(n * D, a) : nullptr;
  acts.dxn = carver.Floats(n * D);
  acts.dqkv = carver.Take(qkv, a);
  acts.dattn = carver.Take(n * H * hd, a);
  acts.dgate_up = carver.Take(n * 2 * I, a);
  acts.dact = carver.Take(n * I, a);
  return carver.used();
}

Result<LlamaEngine> LlamaEngine::Create(const LlamaConfig& config, int max_batch, LlamaEngineOptions options) {
  ESTUARY_RETURN_IF_ERROR(config.Validate());
  if (max_batch <= 0 || int64_t(max_batch) * config.max_seq_len > INT_MAX / 2) {
    return InvalidArgument("cuda llama: max_batch {} with max_seq_len {} is out of range", max_batch,
                           config.max_seq_len);
  }
  if (options.allow_tf32 && options.precision != DType::kF32) {
    return InvalidArgument("cuda llama: allow_tf32 applies to f32 training, not {}", DTypeName(options.precision));
  }
  ESTUARY_RETURN_IF_ERROR(CudaUsable());
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.who = "cuda llama";
  m.config = config;
  m.options = options;
  m.precision = options.precision;
  m.max_batch = max_batch;
  m.scaler = LossScaler(options.loss_scaler);
  m.flash = options.flash_attention && FlashAttentionSupports(options.precision, config.head_dim());
  m.BuildManifest();
  const int64_t max_n = int64_t(max_batch) * config.max_seq_len;

  ESTUARY_RETURN_IF_ERROR(m.UseStream(options.stream));
  ESTUARY_ASSIGN_OR_RETURN(m.blas, Blas::Create(m.s()));
  // A frozen base has no gradient buffer: that memory (4 bytes per parameter) is what it saves.
  ESTUARY_RETURN_IF_ERROR(m.AllocateFlat(/*with_gradients=*/!m.frozen()));
  if (m.frozen()) {
    ESTUARY_ASSIGN_OR_RETURN(m.frozen_dnorm, DeviceBuffer::Allocate(size_t(config.hidden_size) * sizeof(float)));
  }
  const int64_t half = config.head_dim() / 2;
  ESTUARY_ASSIGN_OR_RETURN(m.rope, DeviceBuffer::Allocate(size_t(2 * config.max_seq_len * half) * sizeof(float)));
  ESTUARY_RETURN_IF_ERROR(RopeTables(config.max_seq_len, config.head_dim(), config.rope_theta, m.rope.as<float>(),
                                     m.rope.as<float>() + config.max_seq_len * half, m.s()));
  ESTUARY_ASSIGN_OR_RETURN(m.ids, DeviceBuffer::Allocate(size_t(2 * max_n) * sizeof(int32_t)));
  ESTUARY_ASSIGN_OR_RETURN(m.misc, DeviceBuffer::Allocate(512));  // loss, found-inf flag; the norm at +256
  ESTUARY_RETURN_IF_ERROR(FillBytes(m.misc.data(), 0, m.misc.size(), m.s()));
  ESTUARY_ASSIGN_OR_RETURN(m.staging, PinnedBuffer::Allocate(size_t(2 * max_n) * sizeof(int32_t)));
  ESTUARY_ASSIGN_OR_RETURN(m.staging_free, Event::Create());

  // Every buffer's size grows with batch and seq, so the largest shape's
  // carving covers every smaller one.
  const size_t activation_bytes = m.Carve(max_batch, config.max_seq_len, nullptr);
  ESTUARY_ASSIGN_OR_RETURN(m.activation_buffer, DeviceBuffer::Allocate(activation_bytes));
  // The largest single op's scratch, plus slack for alignment and for CUB,
  // whose temporary storage for a shorter batch is not promised to be smaller.
  ESTUARY_ASSIGN_OR_RETURN(const size_t sort_bytes, EmbeddingBackwardScratchBytes(int(max_n)));
  const size_t scratch_bytes =
      std::max({sort_bytes, RmsNormBackwardScratchBytes(int(max_n), config.hidden_size),
                size_t(max_n) * sizeof(float), size_t(8) << 10 /* clip: 1024 doubles and a float */}) +
      (size_t(64) << 10);
  ESTUARY_ASSIGN_OR_RETURN(m.scratch, Arena::Create(scratch_bytes));
  m.loss = m.loss_d();
  m.clip_norm = m.norm_d();
  m.clip_scratch = &m.scratch;
  // Surfaces any error from the setup above here.
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.s()));
  return LlamaEngine(std::move(impl));
}

LlamaEngine::LlamaEngine(std::unique_ptr<Impl> impl) : Engine(std::move(impl)) {}
LlamaEngine::Impl& LlamaEngine::impl() const { return static_cast<Impl&>(state()); }

const LlamaConfig& LlamaEngine::config() const { return impl().config; }
int LlamaEngine::max_batch() const { return impl().max_batch; }
size_t LlamaEngine::activation_bytes() const { return impl().activation_buffer.size(); }
LossScaler& LlamaEngine::loss_scaler() { return impl().scaler; }

// ------------------------------------------------------------- parameters

Status LlamaEngine::Initialize(uint64_t seed) {
  std::vector<float> host(impl().manifest.total_elements);
  InitializeLlamaParameters(impl().manifest, seed, host);
  return CopyParametersFrom(host);
}

Status LlamaEngine::Impl::UploadParameters(std::span<const float> host) {
  if (master()) return EngineState::UploadParameters(host);
  // Through an fp32 staging chunk into the working copy, which rounds.
  ESTUARY_ASSIGN_OR_RETURN(DeviceBuffer chunk, ConversionChunk());
  const size_t step = chunk.size() / sizeof(float);
  for (size_t at = 0; at < host.size(); at += step) {
    const size_t count = std::min(step, host.size() - at);
    ESTUARY_RETURN_IF_ERROR(CopyToDevice(chunk.data(), host.data() + at, count * sizeof(float), s()));
    ESTUARY_RETURN_IF_ERROR(Convert(chunk.data(), DType::kF32, working.as<char>() + at * DTypeSize(act()), act(),
                                    int64_t(count), s()));
  }
  ESTUARY_RETURN_IF_ERROR(WidenNorms());
  // The chunk is freed on return: the stream must be done with it.
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s()));
  return Status::Ok();
}

Status LlamaEngine::Impl::DownloadParameters(std::span<float> host) {
  if (master()) return EngineState::DownloadParameters(host);
  ESTUARY_ASSIGN_OR_RETURN(DeviceBuffer chunk, ConversionChunk());
  const size_t step = chunk.size() / sizeof(float);
  for (size_t at = 0; at < host.size(); at += step) {
    const size_t count = std::min(step, host.size() - at);
    ESTUARY_RETURN_IF_ERROR(Convert(working.as<char>() + at * DTypeSize(act()), act(), chunk.data(), DType::kF32,
                                    int64_t(count), s()));
    ESTUARY_RETURN_IF_ERROR(CopyToHost(host.data() + at, chunk.data(), count * sizeof(float), s()));
  }
  return Status::Ok();
}

Status LlamaEngine::DropFp32Master() {
  Impl& m = impl();
  if (!m.frozen()) {
    return FailedPrecondition("cuda llama: only a frozen base (train_base false) can drop its fp32 master; a "
                              "trained one steps it");
  }
  if (!m.low()) {
    return FailedPrecondition("cuda llama: an f32 engine has no low-precision working copy to keep its weights in; "
                              "drop the fp32 master under bf16 or f16");
  }
  if (!m.master()) return Status::Ok();
  // The working copy already is the master rounded (CopyParametersFrom keeps
  // it so); the norms get their fp32 copy from it, then the master goes.
  uint64_t total = 0;
  for (const TensorSpec& t : m.manifest.tensors) {
    if (t.shape.size() != 1) continue;
    m.norm_slots.push_back({t.offset, t.numel(), total});
    total += t.numel();
  }
  ESTUARY_ASSIGN_OR_RETURN(m.norms, DeviceBuffer::Allocate(total * sizeof(float)));
  ESTUARY_RETURN_IF_ERROR(m.WidenNorms());
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.s()));
  m.params = DeviceBuffer();
  return Status::Ok();
}

bool LlamaEngine::has_fp32_master() const { return impl().master(); }

Status LlamaEngine::Impl::WidenNorms() const {
  for (const NormSlot& n : norm_slots) {
    ESTUARY_RETURN_IF_ERROR(Convert(working.as<char>() + n.offset * DTypeSize(act()), act(), norms.as<float>() + n.slot,
                                    DType::kF32, int64_t(n.count), s()));
  }
  return Status::Ok();
}

Result<DeviceBuffer> LlamaEngine::Impl::ConversionChunk() const {
  constexpr size_t kChunk = size_t(16) << 20;  // values: 64 MiB of fp32
  return DeviceBuffer::Allocate(std::min<size_t>(kChunk, manifest.total_elements) * sizeof(float));
}

// ---------------------------------------------------------------- training

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

Status LlamaEngine::Impl::RunForward(int batch, int seq) {
  const LlamaConfig& c = config;
  const int n = batch * seq, D = c.hidden_size, I = c.intermediate_size, hd = c.head_dim(), V = c.vocab_size;
  const int H = c.num_heads, KV = c.num_kv_heads;
  const int64_t qkv_width = int64_t(H + 2 * KV) * hd;
  const float eps = float(c.rms_norm_eps);
  Carve(batch, seq, activation_buffer.as<char>());
  ESTUARY_RETURN_IF_ERROR(Embed(n, acts.resid));
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerOffsets& o = offsets[l];
    const LayerActivations& a = acts.layers[l];
    const float* x = acts.resid + l * acts.resid_stride;
    float* out = acts.resid + (l + 1) * acts.resid_stride;
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
    ESTUARY_RETURN_IF_ERROR(
        Gemm(blas, false, true, n, D, int64_t(H) * hd, 1.0f, a.attn, int64_t(H) * hd, W(o.o), int64_t(H) * hd, 0.0f,
             a.h, D, ToF32()));
    ESTUARY_RETURN_IF_ERROR(AdaptForward(l, Projection::kO, a.attn, n, a.h, DType::kF32));
    ESTUARY_RETURN_IF_ERROR(ResidualAdd(x, int64_t(n) * D, a.h, s()));
    ESTUARY_RETURN_IF_ERROR(RmsNormForward(a.h, Norm(o.post_norm), n, D, eps, a.xn2, act(), a.rstd2, s()));
    ESTUARY_RETURN_IF_ERROR(
        Gemm(blas, false, true, n, 2 * int64_t(I), D, 1.0f, a.xn2, D, W(o.gate_up), D, 0.0f, a.gate_up, 2 * I, Same()));
    ESTUARY_RETURN_IF_ERROR(AdaptForward(l, Projection::kGateUp, a.xn2, n, a.gate_up, act()));
    ESTUARY_RETURN_IF_ERROR(SwiGluForward(a.gate_up, n, I, a.act, act(), s()));
    ESTUARY_RETURN_IF_ERROR(Gemm(blas, false, true, n, D, I, 1.0f, a.act, I, W(o.down), I, 0.0f, out, D, ToF32()));
    ESTUARY_RETURN_IF_ERROR(AdaptForward(l, Projection::kDown, a.act, n, out, DType::kF32));
    ESTUARY_RETURN_IF_ERROR(ResidualAdd(a.h, int64_t(n) * D, out, s()));
  }
  ESTUARY_RETURN_IF_ERROR(RmsNormForward(acts.resid + c.num_layers * acts.resid_stride, Norm(final_norm), n, D, eps,
                                         acts.xn_final, act(), acts.rstd_final, s()));
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

Result<bool> LlamaEngine::Impl::UnscaleGradients() {
  if (act() != DType::kF16) return true;
  // GradScaler.step: unscale, check, and skip the update on inf/NaN. The flag
  // read is this step's one host synchronisation.
  ESTUARY_RETURN_IF_ERROR(UnscaleAndCheckFinite(G(), count(), scaler.inv_scale(), found_inf_d(), s()));
  ESTUARY_ASSIGN_OR_RETURN(const bool found_inf, ReadFoundInf(found_inf_d(), s()));
  scaler.Update(found_inf);
  return !found_inf;
}

}  // namespace estuary::models::cuda
