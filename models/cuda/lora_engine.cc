#include "models/cuda/lora_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <optional>
#include <vector>

#include "models/cuda/check.h"
#include "models/cuda/engine_state.h"
#include "models/cuda/precision.h"
#include "models/cuda/sizes.h"

namespace estuary::models::cuda {
namespace {

// An adapted module's place in its fused projection's output: the column its
// block starts at.
struct Slot {
  LoraModule module;
  int64_t column;
};
// The modules of one fused projection (at most q, k, v): a fixed array, so a
// step allocates nothing.
struct Slots {
  Slot slot[3];
  int count = 0;
  const Slot* begin() const { return slot; }
  const Slot* end() const { return slot + count; }
};

}  // namespace

// The adapter buffers and the manifest are the EngineState's.
struct LoraLlamaEngine::Impl final : EngineState, ProjectionAdapters {
  LlamaConfig config;
  LoraConfig lora;
  bool allow_tf32 = false;
  LoraLayout layout;
  int64_t max_n = 0;  // max_batch * max_seq_len rows
  float scale = 0;    // alpha / rank
  // Per (layer, module): where its kept x·Aᵀ [max_n, rank] starts in `kept`
  // (elements of the activation dtype); -1 when not adapted.
  std::vector<int64_t> kept_at;

  // The base is declared last, so it is destroyed first: nothing is enqueued
  // after that, and the buffers below and the EngineState's go through
  // cudaFree, which waits for the device, so no kernel of a last step still
  // reads them.
  DeviceBuffer kept, scratch_u, misc;
  Arena scratch;  // ClipGradNorm's partial sums
  std::optional<LlamaEngine> base;

  void* Kept(int layer, LoraModule m) const {
    return kept.as<char>() + kept_at[size_t(layer) * kLoraModules + size_t(m)] * int64_t(DTypeSize(precision));
  }
  double* norm_d() const { return misc.as<double>(); }
  GemmTypes Types(DType output) const { return {precision, output, allow_tf32 && !low()}; }

  // The modules adapted on projection p and its fused output width.
  int64_t Width(Projection p) const {
    const int64_t hd = config.head_dim();
    switch (p) {
      case Projection::kQkv: return int64_t(config.num_heads + 2 * config.num_kv_heads) * hd;
      case Projection::kO: return config.hidden_size;
      case Projection::kGateUp: return 2 * int64_t(config.intermediate_size);
      case Projection::kDown: return config.hidden_size;
    }
    return 0;
  }
  Slots SlotsOf(Projection p) const {
    const int64_t hd = config.head_dim(), H = config.num_heads, KV = config.num_kv_heads;
    switch (p) {
      case Projection::kQkv:
        return {{{LoraModule::kQ, 0}, {LoraModule::kK, H * hd}, {LoraModule::kV, (H + KV) * hd}}, 3};
      case Projection::kO: return {{{LoraModule::kO, 0}}, 1};
      case Projection::kGateUp: return {{{LoraModule::kGate, 0}, {LoraModule::kUp, config.intermediate_size}}, 2};
      case Projection::kDown: return {{{LoraModule::kDown, 0}}, 1};
    }
    return {};
  }

  Status CheckCall(const char* what, int layer, int n) const {
    if (layer < 0 || layer >= config.num_layers || n < 1 || n > max_n) {
      return InvalidArgument("cuda lora: {} for layer {} with {} rows; expected a layer in [0, {}) and rows in [1, {}]",
                             what, layer, n, config.num_layers, max_n);
    }
    return Status::Ok();
  }

  // y[:, column block] += scale · (x·Aᵀ)·Bᵀ, keeping x·Aᵀ for backward.
  Status Forward(const Blas& blas, int layer, Projection p, const void* x, int n, void* y, DType y_dtype) override {
    ESTUARY_RETURN_IF_ERROR(CheckCall("forward", layer, n));
    const int64_t ld = Width(p), r = lora.rank;
    for (const Slot& slot : SlotsOf(p)) {
      const LoraLayout::Adapter& ad = layout.layers[layer][int(slot.module)];
      if (!ad.present) continue;
      void* xa = Kept(layer, slot.module);
      ESTUARY_RETURN_IF_ERROR(
          Gemm(blas, false, true, n, r, ad.in, 1.0f, x, ad.in, W(ad.a), ad.in, 0.0f, xa, r, Types(precision)));
      ESTUARY_RETURN_IF_ERROR(Gemm(blas, false, true, n, ad.out, r, scale, xa, r, W(ad.b), r, 1.0f,
                                   Advance(y, slot.column, y_dtype), ld, Types(y_dtype)));
    }
    return Status::Ok();
  }

  // From dy's column block: dB = scale · dyᵀ·xa, u = scale · dy·B (the
  // gradient at x·Aᵀ), dA = uᵀ·x, and dx += u·A — models::LoraLinear::Backward.
  Status Backward(const Blas& blas, int layer, Projection p, const void* x, const void* dy, int n, void* dx,
                  DType dx_dtype) override {
    ESTUARY_RETURN_IF_ERROR(CheckCall("backward", layer, n));
    const int64_t ld = Width(p), r = lora.rank;
    void* u = scratch_u.data();
    for (const Slot& slot : SlotsOf(p)) {
      const LoraLayout::Adapter& ad = layout.layers[layer][int(slot.module)];
      if (!ad.present) continue;
      const void* dy_block = Advance(dy, slot.column, precision);
      const void* xa = Kept(layer, slot.module);
      ESTUARY_RETURN_IF_ERROR(Gemm(blas, true, false, ad.out, r, n, scale, dy_block, ld, xa, r, 0.0f, G() + ad.b, r,
                                   Types(DType::kF32)));
      ESTUARY_RETURN_IF_ERROR(
          Gemm(blas, false, false, n, r, ad.out, scale, dy_block, ld, W(ad.b), r, 0.0f, u, r, Types(precision)));
      ESTUARY_RETURN_IF_ERROR(
          Gemm(blas, true, false, r, ad.in, n, 1.0f, u, r, x, ad.in, 0.0f, G() + ad.a, ad.in, Types(DType::kF32)));
      if (dx) {
        ESTUARY_RETURN_IF_ERROR(
            Gemm(blas, false, false, n, ad.in, r, 1.0f, u, r, W(ad.a), ad.in, 1.0f, dx, ad.in, Types(dx_dtype)));
      }
    }
    return Status::Ok();
  }
};

Result<LoraLlamaEngine> LoraLlamaEngine::Create(const LlamaConfig& config, const LoraConfig& lora, int max_batch,
                                                LlamaEngineOptions options) {
  ESTUARY_RETURN_IF_ERROR(config.Validate());
  ESTUARY_RETURN_IF_ERROR(lora.Validate());
  if (const std::string lacks = GpuEngineLacks(config); !lacks.empty()) {
    return InvalidArgument("cuda lora: the GPU engine does not implement {}; train this {} on the CPU engine", lacks,
                           config.architecture);
  }
  if (lora.dropout > 0) {
    return InvalidArgument("cuda lora: lora_dropout {} is not implemented on the GPU (only on the CPU LoraLlama); "
                           "use 0", lora.dropout);
  }
  if (options.precision == DType::kF16) {
    return InvalidArgument("cuda lora: f16 is not supported (the loss scaler does not unscale the adapter "
                           "gradients yet); use bf16 or f32");
  }
  if (options.adapters) {
    return InvalidArgument("cuda lora: options.adapters must be null: the LoRA engine is the base's adapter");
  }
  if (max_batch <= 0 || int64_t(max_batch) * config.max_seq_len > INT_MAX / 2) {
    return InvalidArgument("cuda lora: max_batch {} with max_seq_len {} is out of range", max_batch,
                           config.max_seq_len);
  }
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.who = "cuda lora";
  m.adapters = true;
  m.config = config;
  m.lora = lora;
  m.precision = options.precision;
  m.allow_tf32 = options.allow_tf32;
  m.layout = LoraLayoutOf(config, lora);
  m.manifest = m.layout.manifest;
  m.units = m.layout.units;
  m.max_n = int64_t(max_batch) * config.max_seq_len;
  m.scale = float(lora.scale());

  options.train_base = false;
  options.adapters = &m;  // stable: Impl lives on the heap, and moves of the engine move the pointer to it
  ESTUARY_ASSIGN_OR_RETURN(LlamaEngine base, LlamaEngine::Create(config, max_batch, options));
  m.base.emplace(std::move(base));
  m.stream = m.base->stream();
  m.loss = m.base->device_loss();

  const size_t a = DTypeSize(m.precision);
  ESTUARY_RETURN_IF_ERROR(m.AllocateFlat(/*with_gradients=*/true));
  // One [max_n, rank] block per adapted module, each 256-byte aligned (the
  // alignment cuBLAS's fastest kernels want).
  m.kept_at.assign(size_t(config.num_layers) * kLoraModules, -1);
  const int64_t block = m.max_n * lora.rank;
  const int64_t aligned = (block * int64_t(a) + 255) / 256 * 256 / int64_t(a);
  int64_t kept = 0;
  for (int l = 0; l < config.num_layers; ++l) {
    for (int mod = 0; mod < kLoraModules; ++mod) {
      if (!m.layout.layers[l][mod].present) continue;
      m.kept_at[size_t(l) * kLoraModules + size_t(mod)] = kept;
      kept += aligned;
    }
  }
  ESTUARY_ASSIGN_OR_RETURN(m.kept, DeviceBuffer::Allocate(size_t(kept) * a));
  ESTUARY_ASSIGN_OR_RETURN(m.scratch_u, DeviceBuffer::Allocate(size_t(block) * a));
  ESTUARY_ASSIGN_OR_RETURN(m.misc, DeviceBuffer::Allocate(256));  // the clipping norm (a double)
  ESTUARY_RETURN_IF_ERROR(FillBytes(m.misc.data(), 0, m.misc.size(), m.s()));
  ESTUARY_ASSIGN_OR_RETURN(m.scratch, Arena::Create((size_t(8) << 10) + (size_t(64) << 10)));  // as LlamaEngine's clip
  m.clip_norm = m.norm_d();
  m.clip_scratch = &m.scratch;
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.s()));
  return LoraLlamaEngine(std::move(impl));
}

LoraLlamaEngine::LoraLlamaEngine(std::unique_ptr<Impl> impl) : Engine(std::move(impl)) {}
LoraLlamaEngine::Impl& LoraLlamaEngine::impl() const { return static_cast<Impl&>(state()); }

const LoraConfig& LoraLlamaEngine::lora_config() const { return impl().lora; }
LlamaEngine& LoraLlamaEngine::base() { return *impl().base; }
const LlamaEngine& LoraLlamaEngine::base() const { return *impl().base; }
size_t LoraLlamaEngine::adapter_activation_bytes() const { return impl().kept.size() + impl().scratch_u.size(); }

Status LoraLlamaEngine::Initialize(uint64_t seed) {
  std::vector<float> host(impl().manifest.total_elements);
  InitializeLoraAdapters(impl().layout, seed, host);
  return CopyParametersFrom(host);
}

Status LoraLlamaEngine::CopyParametersFrom(uint64_t offset, std::span<const float> host) {
  Impl& m = impl();
  if (offset > uint64_t(m.count()) || host.size() > uint64_t(m.count()) - offset) {
    return InvalidArgument("cuda lora: {} adapter parameters at offset {} overrun the adapters' {}", host.size(),
                           offset, m.count());
  }
  return CopyToDevice(m.P() + offset, host.data(), host.size_bytes(), m.s());
}

Status LoraLlamaEngine::ForwardBackwardAsync(const int32_t* tokens, const int32_t* targets, int batch, int seq,
                                             const BackwardOptions& options) {
  // The base checks the ids, sizes, grad_scale and accumulate, then runs the
  // frozen decoder with this engine's adapters (Impl::Forward, Impl::Backward).
  // Its own hooks would speak of base offsets: the adapters report here.
  BackwardOptions base_options = options;
  base_options.hooks = nullptr;
  ESTUARY_RETURN_IF_ERROR(impl().base->ForwardBackwardAsync(tokens, targets, batch, seq, base_options));
  // Every adapter gradient is final once backward is enqueued: one report, so
  // DDP reduces the (small) adapter buffer after backward, not during it.
  if (options.hooks) options.hooks->GradientsFinal(0);
  return Status::Ok();
}

Result<float> LoraLlamaEngine::ForwardBackward(const int32_t* tokens, const int32_t* targets, int batch, int seq) {
  ESTUARY_RETURN_IF_ERROR(ForwardBackwardAsync(tokens, targets, batch, seq));
  return ReadLoss();
}

Status LoraLlamaEngine::Forward(const int32_t* tokens, int batch, int seq, float* logits) {
  return impl().base->Forward(tokens, batch, seq, logits);
}

}  // namespace estuary::models::cuda
