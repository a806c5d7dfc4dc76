#include "models/lora.h"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "base/seed.h"
#include "models/flat_buffer.h"
#include "models/precision.h"
#include "models/transformer_ops.h"

namespace estuary::models {

namespace {

constexpr LoraModule kAllModules[kLoraModules] = {LoraModule::kQ,    LoraModule::kK,  LoraModule::kV,
                                                  LoraModule::kO,    LoraModule::kGate, LoraModule::kUp,
                                                  LoraModule::kDown};

// "self_attn.q_proj", ...: the module's path inside a block.
std::string ModulePath(LoraModule m) {
  const bool attention = m == LoraModule::kQ || m == LoraModule::kK || m == LoraModule::kV || m == LoraModule::kO;
  return fmt::format("{}.{}", attention ? "self_attn" : "mlp", LoraModuleName(m));
}

// PEFT saves a LoraModel's adapters under its wrapper's prefix, without the
// adapter's name ("default").
constexpr const char* kPeftPrefix = "base_model.model.";

}  // namespace

std::string_view LoraModuleName(LoraModule module) {
  switch (module) {
    case LoraModule::kQ: return "q_proj";
    case LoraModule::kK: return "k_proj";
    case LoraModule::kV: return "v_proj";
    case LoraModule::kO: return "o_proj";
    case LoraModule::kGate: return "gate_proj";
    case LoraModule::kUp: return "up_proj";
    case LoraModule::kDown: return "down_proj";
  }
  return "?";
}

bool LoraConfig::Targets(LoraModule module) const {
  return std::find(target_modules.begin(), target_modules.end(), LoraModuleName(module)) != target_modules.end();
}

Status LoraConfig::Validate() const {
  if (rank <= 0) return InvalidArgument("lora config: r is {}; it must be positive", rank);
  if (!(alpha > 0) || !std::isfinite(alpha)) {
    return InvalidArgument("lora config: lora_alpha {} must be positive and finite", alpha);
  }
  if (!(dropout >= 0 && dropout < 1)) {
    return InvalidArgument("lora config: lora_dropout is {}; it must be in [0, 1)", dropout);
  }
  if (target_modules.empty()) return InvalidArgument("lora config: target_modules is empty");
  std::set<std::string> seen;
  for (const std::string& name : target_modules) {
    const bool known = std::any_of(std::begin(kAllModules), std::end(kAllModules),
                                   [&](LoraModule m) { return LoraModuleName(m) == name; });
    if (!known) {
      return InvalidArgument(
          "lora config: target module '{}' is not one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
          "down_proj",
          name);
    }
    if (!seen.insert(name).second) return InvalidArgument("lora config: target module '{}' is listed twice", name);
  }
  return Status::Ok();
}

// ------------------------------------------------------------ one adapter

void LoraLinear::Forward(const float* x, int n, float* xa, float* y, int64_t ldy) const {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, rank, in, 1.0f, x, in, a, in, 0.0f, xa, rank);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, rank, scale, xa, rank, b, rank, 1.0f, y, int(ldy));
}

void LoraLinear::Backward(const float* x, const float* xa, const float* dy, int64_t ldy, int n, float* t,
                          float* dx, bool accumulate) const {
  const float beta = accumulate ? 1.0f : 0.0f;
  // dB [out, rank] = scale · dyᵀ · xa
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, rank, n, scale, dy, int(ldy), xa, rank, beta, db, rank);
  // t [n, rank] = scale · dy · B: the gradient at x·Aᵀ, shared by dA and dx.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, rank, out, scale, dy, int(ldy), b, rank, 0.0f, t, rank);
  // dA [rank, in] = tᵀ · x
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, rank, in, n, 1.0f, t, rank, x, in, beta, da, in);
  // dx += t · A
  if (dx) cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, in, rank, 1.0f, t, rank, a, in, 1.0f, dx, in);
}

// ------------------------------------------------------------------ model

LoraLayout LoraLayoutOf(const LlamaConfig& c, const LoraConfig& config) {
  const int D = c.hidden_size, I = c.intermediate_size, r = config.rank;
  const int q_rows = c.num_heads * c.head_dim(), kv_rows = c.num_kv_heads * c.head_dim();
  // (in, out) of each module, in kAllModules order.
  const std::pair<int, int> dims[kLoraModules] = {{D, q_rows}, {D, kv_rows}, {D, kv_rows}, {q_rows, D},
                                                 {D, I},      {D, I},       {I, D}};
  LoraLayout layout;
  Manifest& manifest = layout.manifest;
  layout.layers.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    for (LoraModule m : kAllModules) {
      if (!config.Targets(m)) continue;
      const auto [in, out] = dims[int(m)];
      const std::string p = fmt::format("{}model.layers.{}.{}.", kPeftPrefix, l, ModulePath(m));
      LoraLayout::Adapter& adapter = layout.layers[l][int(m)];
      adapter.present = true;
      adapter.in = in;
      adapter.out = out;
      adapter.rank = r;
      if (layout.units.size() == size_t(l)) {  // the layer's first adapter opens its unit
        if (!layout.units.empty()) layout.units.back().end = manifest.total_elements;
        layout.units.push_back({fmt::format("model.layers.{}", l), manifest.total_elements, 0});
      }
      adapter.a = manifest.Append(p + "lora_A.weight", {r, in});
      adapter.b = manifest.Append(p + "lora_B.weight", {out, r});
    }
  }
  if (!layout.units.empty()) layout.units.back().end = manifest.total_elements;
  return layout;
}

void InitializeLoraAdapters(const LoraLayout& layout, uint64_t seed, std::span<float> params) {
  std::mt19937_64 rng(seed);
  for (const auto& layer : layout.layers) {
    for (const LoraLayout::Adapter& m : layer) {
      if (!m.present) continue;
      const int64_t rank = m.rank;
      float* a = params.data() + m.a;
      float* b = params.data() + m.b;
      // kaiming_uniform_(a=√5): gain √(2/(1+5)), bound = gain·√3/√fan_in = 1/√in.
      const double bound = 1.0 / std::sqrt(double(m.in));
      for (int64_t i = 0; i < rank * m.in; ++i) {
        const double u = double(rng() >> 11) * 0x1.0p-53;  // [0, 1)
        a[i] = float((2 * u - 1) * bound);
      }
      std::fill(b, b + int64_t(m.out) * rank, 0.0f);
    }
  }
}

LoraLlama::LoraLlama(Llama base, const LoraConfig& config) : base_(std::move(base)), lora_config_(config) {
  const LlamaConfig& c = base_.config();
  const int D = c.hidden_size, r = config.rank;
  layout_ = LoraLayoutOf(c, config);
  const LoraLayout& layout = layout_;
  params_ = FlatBuffer<float>(layout.manifest.total_elements);
  grads_ = FlatBuffer<float>(layout.manifest.total_elements);
  layers_.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    for (LoraModule m : kAllModules) {
      const LoraLayout::Adapter& p = layout.layers[l][int(m)];
      if (!p.present) continue;
      layers_[l][int(m)] = LoraLinear{p.in,
                                      p.out,
                                      r,
                                      float(config.scale()),
                                      params_.data() + p.a,
                                      params_.data() + p.b,
                                      grads_.data() + p.a,
                                      grads_.data() + p.b};
    }
  }
  xa_rows_ = int64_t(base_.max_batch()) * c.max_seq_len;
  xa_.resize(size_t(c.num_layers) * kLoraModules * size_t(xa_rows_) * size_t(r));
  t_.resize(size_t(xa_rows_) * size_t(r));
  dnorm_.resize(size_t(D));
  if (config.dropout > 0) {
    size_t total = 0, widest = 0;
    xd_at_.resize(size_t(c.num_layers) * kLoraModules);
    for (int l = 0; l < c.num_layers; ++l) {
      for (LoraModule m : kAllModules) {
        const LoraLayout::Adapter& p = layout.layers[l][int(m)];
        if (!p.present) continue;
        const size_t in = size_t(p.in);
        // Under recompute every layer's dropped inputs share layer 0's
        // region, as the base's activations do: backward redraws them.
        if (base_.recompute() && l > 0) {
          xd_at_[size_t(l) * kLoraModules + size_t(m)] = xd_at_[size_t(m)];
          continue;
        }
        xd_at_[size_t(l) * kLoraModules + size_t(m)] = total;
        total += size_t(xa_rows_) * in;
        widest = std::max(widest, in);
      }
    }
    xd_.resize(total);
    dxd_.resize(size_t(xa_rows_) * widest);
  }
}

Result<LoraLlama> LoraLlama::Create(Llama base, const LoraConfig& config) {
  ESTUARY_RETURN_IF_ERROR(config.Validate());
  return LoraLlama(std::move(base), config);
}

void LoraLlama::Initialize(uint64_t seed) { InitializeLoraAdapters(layout_, seed, params_); }

void LoraLlama::StoreBaseInBf16() {
  std::span<float> base = base_.parameters();
  base_bf16_.resize(base.size());
  FloatToBf16(base, base_bf16_);
  (void)ReleasePages(base);  // madvise on our own mmap: nothing to report
}

Status LoraLlama::LoadBase(std::span<const float> weights) {
  std::span<float> base = base_.parameters();
  if (weights.size() != base.size()) {
    return InvalidArgument("lora llama: {} base weights given, the base has {}", weights.size(), base.size());
  }
  if (base_in_bf16()) {
    FloatToBf16(weights, base_bf16_);
  } else {
    std::copy(weights.begin(), weights.end(), base.begin());
  }
  return Status::Ok();
}

void LoraLlama::OpenBase(int unit) {
  if (!base_in_bf16()) return;
  const ParameterUnit& u = base_.units_[size_t(unit)];
  Bf16ToFloat(std::span<const uint16_t>(base_bf16_).subspan(u.begin, u.end - u.begin),
              base_.parameters().subspan(u.begin, u.end - u.begin));
}

void LoraLlama::CloseBase(int unit) {
  if (!base_in_bf16()) return;
  const ParameterUnit& u = base_.units_[size_t(unit)];
  (void)ReleasePages(base_.parameters().subspan(u.begin, u.end - u.begin));
}

// Counter-based (base/seed.h's mixing): a mask is a pure function of its
// coordinates, so backward redraws it instead of storing it.
uint64_t LoraLlama::MaskStream(int layer, LoraModule m) const {
  return MixSeed(MixSeed(dropout_seed_, dropout_step_), uint64_t(layer) * kLoraModules + uint64_t(m));
}

static bool Kept(uint64_t stream, int64_t i, double p) {
  return double(SplitMix64(stream + uint64_t(i)) >> 11) * 0x1.0p-53 >= p;  // uniform [0, 1) >= p
}

// dropout(x) of module m in layer l this step, into Dropped(l, m).
const float* LoraLlama::Drop(int l, LoraModule m, const float* x, int n) {
  const LoraLinear& adapter = layers_[l][int(m)];
  float* xd = Dropped(l, m);
  const uint64_t stream = MaskStream(l, m);
  const double p = lora_config_.dropout;
  const float keep_scale = float(1.0 / (1.0 - p));
  const int64_t first = dropout_first_row_ * adapter.in;
  // Inverted dropout, as nn.Dropout: kept elements scaled by 1/(1-p).
  for (int64_t i = 0; i < int64_t(n) * adapter.in; ++i) xd[i] = Kept(stream, first + i, p) ? x[i] * keep_scale : 0.0f;
  return xd;
}

// Block l of the base decoder's forward (Llama::ForwardBlock) with each
// adapter added to its projection's output before anything reads it (q and k
// before RoPE).
void LoraLlama::ForwardBlock(int l, int batch, int seq, bool train, bool to_output) {
  const LlamaConfig& c = base_.config();
  const int n = batch * seq, D = c.hidden_size, I = c.intermediate_size, hd = c.head_dim();
  const int H = c.num_heads, KV = c.num_kv_heads;
  const int64_t qkv_width = int64_t(H + 2 * KV) * hd;
  const float eps = float(c.rms_norm_eps);
  const float *cos = base_.rope_cos_.data(), *sin = base_.rope_sin_.data();
  const Llama::Activations& acts = base_.acts_;
  // Column offsets of q, k, v in the fused qkv output, and of gate, up in gate_up.
  const int64_t q_at = 0, k_at = int64_t(H) * hd, v_at = int64_t(H + KV) * hd;
  const bool dropout = train && lora_config_.dropout > 0;
  auto adapt = [&](LoraModule m, const float* x, float* y, int64_t ldy) {
    const LoraLinear& adapter = layers_[l][int(m)];
    if (!adapter.a) return;
    adapter.Forward(dropout ? Drop(l, m, x, n) : x, n, Xa(l, m), y, ldy);
  };
  const Llama::Layer& layer = base_.layers_[l];
  const Llama::LayerActivations& a = acts.layers[l];
  const float* x = acts.resid + l * acts.resid_stride;
  float* out = acts.resid + (l + 1) * acts.resid_stride;
  RmsNormForward(x, layer.input_norm, n, D, eps, a.xn1, a.rstd1);
  layer.qkv.Forward(a.xn1, n, a.qkv);
  adapt(LoraModule::kQ, a.xn1, a.qkv + q_at, qkv_width);
  adapt(LoraModule::kK, a.xn1, a.qkv + k_at, qkv_width);
  adapt(LoraModule::kV, a.xn1, a.qkv + v_at, qkv_width);
  RopeForward(a.qkv, batch, seq, H, hd, qkv_width, cos, sin);
  RopeForward(a.qkv + k_at, batch, seq, KV, hd, qkv_width, cos, sin);
  AttentionForward(a.qkv, batch, seq, H, KV, hd, a.probs, a.attn);
  layer.o.Forward(a.attn, n, a.h);
  adapt(LoraModule::kO, a.attn, a.h, D);
  ResidualAdd(x, int64_t(n) * D, a.h);
  RmsNormForward(a.h, layer.post_norm, n, D, eps, a.xn2, a.rstd2);
  layer.gate_up.Forward(a.xn2, n, a.gate_up);
  adapt(LoraModule::kGate, a.xn2, a.gate_up, 2 * I);
  adapt(LoraModule::kUp, a.xn2, a.gate_up + I, 2 * I);
  SwiGluForward(a.gate_up, n, I, a.act);
  if (!to_output) {
    // Backward's recomputation: the down adapter's x·Aᵀ is kept per layer,
    // but its dropped input may share one layer's region (recompute).
    if (dropout && layers_[l][int(LoraModule::kDown)].a) Drop(l, LoraModule::kDown, a.act, n);
    return;
  }
  layer.down.Forward(a.act, n, out);
  adapt(LoraModule::kDown, a.act, out, D);
  ResidualAdd(a.h, int64_t(n) * D, out);
}

// The base decoder's forward (Llama::RunForward) with the adapters.
void LoraLlama::RunForward(const int32_t* tokens, int batch, int seq, float* logits, bool train) {
  const LlamaConfig& c = base_.config();
  const int n = batch * seq, D = c.hidden_size;
  const float eps = float(c.rms_norm_eps);
  const Llama::Activations& acts = base_.acts_;
  if (base_in_bf16()) {
    // The lookup reads n rows: unpack those, not the whole table.
    const uint64_t embed = base_.units_[0].begin;
    for (int i = 0; i < n; ++i) {
      Bf16ToFloat(std::span<const uint16_t>(base_bf16_).subspan(embed + uint64_t(tokens[i]) * D, D),
                  std::span<float>(acts.resid + int64_t(i) * D, D));
    }
  } else {
    EmbeddingForward(tokens, n, base_.embed_, D, acts.resid);
  }
  for (int l = 0; l < c.num_layers; ++l) {
    OpenBase(1 + l);
    ForwardBlock(l, batch, seq, train, /*to_output=*/true);
    // A training step's backward starts with the last block: it stays open.
    if (!train || l + 1 < c.num_layers) CloseBase(1 + l);
  }
  // The final norm's unit, and the head's: its own when untied, the
  // embedding's when tied. Backward opens them first, so a training step
  // leaves them open for it.
  const int final_unit = c.num_layers + 1, head_unit = c.tie_embeddings ? 0 : final_unit;
  OpenBase(final_unit);
  RmsNormForward(acts.resid + c.num_layers * acts.resid_stride, base_.final_norm_, n, D, eps, acts.xn_final,
                 acts.rstd_final);
  if (head_unit != final_unit) OpenBase(head_unit);
  base_.lm_head_.Forward(acts.xn_final, n, logits);
  if (train) return;
  if (head_unit != final_unit) CloseBase(head_unit);
  CloseBase(final_unit);
}

Status LoraLlama::Forward(const int32_t* tokens, int batch, int seq, float* logits) {
  ESTUARY_RETURN_IF_ERROR(base_.CheckInput(tokens, nullptr, batch, seq));
  if (!logits) return InvalidArgument("lora llama: no logits buffer given");
  base_.Carve(batch, seq, base_.arena_.data());
  RunForward(tokens, batch, seq, logits, /*train=*/false);
  return Status::Ok();
}

Result<float> LoraLlama::ForwardBackward(const int32_t* tokens, const int32_t* targets, int batch, int seq,
                                         const BackwardOptions& options) {
  if (!targets) return InvalidArgument("lora llama: no target ids given");
  ESTUARY_RETURN_IF_ERROR(base_.CheckInput(tokens, targets, batch, seq));
  if (!std::isfinite(options.grad_scale)) {
    return InvalidArgument("lora llama: grad_scale {} is not finite", options.grad_scale);
  }
  StepHooks& hooks = options.hooks ? *options.hooks : StepHooks::None();
  const bool accumulate = options.accumulate;
  const LlamaConfig& c = base_.config();
  const int n = batch * seq, D = c.hidden_size, I = c.intermediate_size, hd = c.head_dim();
  const int H = c.num_heads, KV = c.num_kv_heads;
  const int64_t qkv_width = int64_t(H + 2 * KV) * hd;
  const int64_t q_at = 0, k_at = int64_t(H) * hd, v_at = int64_t(H + KV) * hd;
  const float *cos = base_.rope_cos_.data(), *sin = base_.rope_sin_.data();
  base_.Carve(batch, seq, base_.arena_.data());
  const Llama::Activations& a = base_.acts_;
  RunForward(tokens, batch, seq, a.logits, /*train=*/true);
  float* dlogits = a.logits;  // in place, as in Llama
  const float loss = CrossEntropyForwardBackward(a.logits, targets, n, c.vocab_size, dlogits, options.grad_scale);

  // Frozen weights: each base projection forms only its input gradient, and
  // the norms' weight gradients go to a scratch row nobody reads (one
  // multiply-add per element, against a GEMM per projection saved).
  auto frozen = [](Linear l) {
    l.dw = l.db = nullptr;
    return l;
  };
  const bool dropout = lora_config_.dropout > 0;
  const float keep_scale = float(1.0 / (1.0 - double(lora_config_.dropout)));
  auto adapt = [&](int l, LoraModule m, const float* x, const float* dy, int64_t ldy, float* dx) {
    const LoraLinear& adapter = layers_[l][int(m)];
    if (!adapter.a) return;
    if (!dropout) {
      adapter.Backward(x, Xa(l, m), dy, ldy, n, t_.data(), dx, accumulate);
      return;
    }
    // dA reads the dropped input; the input gradient goes back through the
    // same mask (redrawn: the hash gives the forward's bits).
    adapter.Backward(Dropped(l, m), Xa(l, m), dy, ldy, n, t_.data(), nullptr, accumulate);
    if (!dx) return;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, adapter.in, adapter.rank, 1.0f, t_.data(),
                adapter.rank, adapter.a, adapter.in, 0.0f, dxd_.data(), adapter.in);
    const uint64_t stream = MaskStream(l, m);
    const double p = lora_config_.dropout;
    const int64_t first = dropout_first_row_ * adapter.in;
    for (int64_t i = 0; i < int64_t(n) * adapter.in; ++i) {
      if (Kept(stream, first + i, p)) dx[i] += dxd_[i] * keep_scale;
    }
  };
  // RunForward left the final norm, the head and the last block open.
  const int final_unit = c.num_layers + 1, head_unit = c.tie_embeddings ? 0 : final_unit;
  frozen(base_.lm_head_).Backward(a.xn_final, dlogits, n, a.dxn);
  if (head_unit != final_unit) CloseBase(head_unit);
  std::memset(a.dresid, 0, sizeof(float) * n * D);
  RmsNormBackward(a.resid + c.num_layers * a.resid_stride, base_.final_norm_, a.rstd_final, a.dxn, n, D, a.dresid,
                  dnorm_.data());
  CloseBase(final_unit);
  // dresid holds dL/d(output of block l) on entry and dL/d(its input) on exit,
  // except for block 0, whose input (the frozen embedding) needs none.
  for (int l = c.num_layers - 1; l >= 0; --l) {
    if (l + 1 < c.num_layers) {
      OpenBase(1 + l);
      // The last block's activations are still the forward pass's.
      if (base_.recompute()) ForwardBlock(l, batch, seq, /*train=*/true, /*to_output=*/false);
    }
    const Llama::Layer& layer = base_.layers_[l];
    const Llama::LayerActivations& s = a.layers[l];
    frozen(layer.down).Backward(s.act, a.dresid, n, a.dact);
    adapt(l, LoraModule::kDown, s.act, a.dresid, D, a.dact);
    SwiGluBackward(s.gate_up, a.dact, n, I, a.dgate_up);
    layer.gate_up.Frozen().Backward(s.xn2, a.dgate_up, n, a.dxn);
    adapt(l, LoraModule::kGate, s.xn2, a.dgate_up, 2 * I, a.dxn);
    adapt(l, LoraModule::kUp, s.xn2, a.dgate_up + I, 2 * I, a.dxn);
    RmsNormBackward(s.h, layer.post_norm, s.rstd2, a.dxn, n, D, a.dresid, dnorm_.data());
    frozen(layer.o).Backward(s.attn, a.dresid, n, a.dattn);
    adapt(l, LoraModule::kO, s.attn, a.dresid, D, a.dattn);
    AttentionBackward(s.qkv, s.probs, a.dattn, batch, seq, H, KV, hd, a.dscores, a.dqkv);
    RopeBackward(a.dqkv, batch, seq, H, hd, qkv_width, cos, sin);
    RopeBackward(a.dqkv + k_at, batch, seq, KV, hd, qkv_width, cos, sin);
    float* dxn = l > 0 ? a.dxn : nullptr;
    layer.qkv.Frozen().Backward(s.xn1, a.dqkv, n, dxn);
    adapt(l, LoraModule::kQ, s.xn1, a.dqkv + q_at, qkv_width, dxn);
    adapt(l, LoraModule::kK, s.xn1, a.dqkv + k_at, qkv_width, dxn);
    adapt(l, LoraModule::kV, s.xn1, a.dqkv + v_at, qkv_width, dxn);
    if (l > 0) {
      RmsNormBackward(a.resid + l * a.resid_stride, layer.input_norm, s.rstd1, a.dxn, n, D, a.dresid,
                      dnorm_.data());
    }
    CloseBase(1 + l);
    hooks.GradientsFinal(layout_.units[l].begin);  // layer 0's is 0: the last call
  }
  ++dropout_step_;
  return loss;
}

Result<Llama> LoraLlama::Merged(int max_batch) const {
  ESTUARY_ASSIGN_OR_RETURN(Llama merged, Llama::Create(base_.config(), max_batch));
  if (base_in_bf16()) {
    Bf16ToFloat(base_bf16_, merged.parameters());
  } else {
    std::copy(base_.parameters().begin(), base_.parameters().end(), merged.parameters().begin());
  }
  for (int l = 0; l < int(layers_.size()); ++l) {
    for (LoraModule m : kAllModules) {
      const LoraLinear& adapter = layers_[l][int(m)];
      if (!adapter.a) continue;
      const TensorSpec* w = merged.manifest().Find(fmt::format("model.layers.{}.{}.weight", l, ModulePath(m)));
      if (!w) return Internal("lora llama: the base has no weight for layer {} {}", l, LoraModuleName(m));
      // W [out, in] += scale · B [out, rank] · A [rank, in]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, adapter.out, adapter.in, adapter.rank, adapter.scale,
                  adapter.b, adapter.rank, adapter.a, adapter.in, 1.0f, merged.parameters().data() + w->offset,
                  adapter.in);
    }
  }
  return merged;
}

}  // namespace estuary::models
