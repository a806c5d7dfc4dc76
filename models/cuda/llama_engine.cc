#include "models/cuda/llama_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>

#include "models/cuda/check.h"
#include "models/cuda/flash_attention.h"
#include "models/cuda/llama_engine_impl.h"
#include "models/cuda/precision.h"
#include "models/transformer_ops.h"

namespace estuary::models::cuda {

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
  // Under recompute one set serves every block in turn.
  acts.layers.resize(options.recompute ? 1 : c.num_layers);
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
  acts.layers.resize(c.num_layers, acts.layers.front());
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
  if (const std::string lacks = GpuEngineLacks(config); !lacks.empty()) {
    return InvalidArgument("cuda llama: the GPU engine does not implement {}; train this {} on the CPU engine", lacks,
                           config.architecture);
  }
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
  // The CPU decoder's own tables, RoPE scaling included, so both engines rotate by the same floats.
  const int64_t half = config.head_dim() / 2;
  std::vector<float> rope(size_t(2 * config.max_seq_len * half));
  models::RopeTables(config.max_seq_len, int(half), config.RopeInverseFrequencies().data(), rope.data(),
             rope.data() + config.max_seq_len * half);
  ESTUARY_ASSIGN_OR_RETURN(m.rope, DeviceBuffer::Allocate(rope.size() * sizeof(float)));
  ESTUARY_RETURN_IF_ERROR(CopyToDevice(m.rope.data(), rope.data(), rope.size() * sizeof(float), m.s()));
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
bool LlamaEngine::recompute() const { return impl().options.recompute; }
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
