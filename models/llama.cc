#include "models/llama.h"

#include <fmt/format.h>

#include <algorithm>
#include <cassert>
#include <climits>
#include <cmath>
#include <cstring>
#include <numbers>
#include <random>

#include "models/transformer_ops.h"

namespace estuary::models {

double LlamaConfig::ParameterCount() const {
  const double V = vocab_size, D = hidden_size, I = intermediate_size, L = num_layers, H = num_heads,
               KV = num_kv_heads, hd = head_dim();
  const double biases = (qkv_bias ? (H + 2 * KV) * hd : 0) + (o_bias ? D : 0) + (mlp_bias ? 2 * I + D : 0);
  return (tie_embeddings ? 1 : 2) * V * D + L * ((2 * H + 2 * KV) * hd * D + 3 * I * D + 2 * D + biases) + D;
}

double LlamaConfig::ActivationsPerSequence() const {
  const double V = vocab_size, D = hidden_size, I = intermediate_size, L = num_layers, H = num_heads,
               KV = num_kv_heads, S = max_seq_len, hd = head_dim();
  return S * D * (L + 1) + L * (H * S * S + S * (4 * D + (2 * H + 2 * KV) * hd + 3 * I)) + S * V;
}

std::vector<double> LlamaConfig::RopeInverseFrequencies() const {
  const int dim = head_dim();
  std::vector<double> inv_freq(dim / 2);
  const RopeScaling& r = rope_scaling;
  const double low_wavelength = r.original_max_position_embeddings / r.low_freq_factor;
  const double high_wavelength = r.original_max_position_embeddings / r.high_freq_factor;
  for (int j = 0; j < dim / 2; ++j) {
    const double f = 1.0 / std::pow(rope_theta, double(2 * j) / dim);
    double scaled = f;
    if (r.kind == RopeScaling::Kind::kLinear) {
      scaled = f / r.factor;
    } else if (r.kind == RopeScaling::Kind::kLlama3) {
      // Wavelengths longer than the original context are stretched by factor,
      // those well inside it kept; between the two, a blend linear in
      // original / wavelength.
      const double wavelength = 2 * std::numbers::pi / f;
      if (wavelength > low_wavelength) {
        scaled = f / r.factor;
      } else if (wavelength >= high_wavelength) {
        const double smooth = (r.original_max_position_embeddings / wavelength - r.low_freq_factor) /
                              (r.high_freq_factor - r.low_freq_factor);
        scaled = (1 - smooth) * f / r.factor + smooth * f;
      }
    }
    inv_freq[j] = scaled;
  }
  return inv_freq;
}

Status LlamaConfig::Validate() const {
  const std::pair<const char*, int> sizes[] = {
      {"vocab_size", vocab_size}, {"hidden_size", hidden_size}, {"intermediate_size", intermediate_size},
      {"num_layers", num_layers}, {"num_heads", num_heads},     {"num_kv_heads", num_kv_heads},
      {"max_seq_len", max_seq_len}};
  for (const auto& [name, value] : sizes) {
    if (value <= 0) return InvalidArgument("llama config: {} is {}; it must be positive", name, value);
  }
  if (explicit_head_dim < 0) {
    return InvalidArgument("llama config: head_dim is {}; it must be positive", explicit_head_dim);
  }
  if (explicit_head_dim == 0 && hidden_size % num_heads != 0) {
    return InvalidArgument("llama config: num_heads {} does not divide hidden_size {}", num_heads, hidden_size);
  }
  if (head_dim() % 2 != 0) {
    if (explicit_head_dim > 0) {
      return InvalidArgument("llama config: head_dim {} is odd; RoPE rotates pairs", head_dim());
    }
    return InvalidArgument("llama config: head_dim {} (hidden_size {} / num_heads {}) is odd; RoPE rotates pairs",
                           head_dim(), hidden_size, num_heads);
  }
  if (num_heads % num_kv_heads != 0) {
    return InvalidArgument("llama config: num_kv_heads {} does not divide num_heads {}", num_kv_heads, num_heads);
  }
  const RopeScaling& r = rope_scaling;
  if (r.kind != RopeScaling::Kind::kNone && !(r.factor > 0 && std::isfinite(r.factor))) {
    return InvalidArgument("llama config: rope_scaling factor {} must be positive and finite", r.factor);
  }
  if (r.kind == RopeScaling::Kind::kLlama3 &&
      !(r.low_freq_factor > 0 && r.high_freq_factor > r.low_freq_factor && std::isfinite(r.high_freq_factor) &&
        r.original_max_position_embeddings > 0)) {
    return InvalidArgument(
        "llama config: rope_scaling low_freq_factor {}, high_freq_factor {}, original_max_position_embeddings {} "
        "must satisfy 0 < low < high and original > 0",
        r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings);
  }
  // What the layout and the activations are computed from must fit, with
  // room: every matrix dimension an int, and the parameters and one
  // sequence's activations (num_heads x max_seq_len^2 attention weights per
  // layer) at most Manifest::kMaxElements, so that no count overflows.
  // (A config.json may say anything; estimated in double, exact enough for a bound.)
  const double V = vocab_size, D = hidden_size, I = intermediate_size, L = num_layers, H = num_heads,
               KV = num_kv_heads, S = max_seq_len, hd = head_dim();
  if ((H + 2 * KV) * hd > INT_MAX || 2 * I > INT_MAX) {
    return InvalidArgument("llama config: the attention's {} or the MLP's {} rows do not fit an int",
                           (H + 2 * KV) * hd, 2 * I);
  }
  const double parameters = ParameterCount();
  const double activations = ActivationsPerSequence();
  constexpr double kMax = double(Manifest::kMaxElements);
  if (parameters > kMax || activations > kMax) {
    return InvalidArgument("llama config: {:.3g} parameters and {:.3g} activations per sequence exceed {:.3g}",
                           parameters, activations, kMax);
  }
  if (!(rms_norm_eps > 0) || !std::isfinite(rms_norm_eps)) {
    return InvalidArgument("llama config: rms_norm_eps {} must be positive and finite", rms_norm_eps);
  }
  if (!(rope_theta > 1) || !std::isfinite(rope_theta)) {
    return InvalidArgument("llama config: rope_theta {} must be finite and greater than 1", rope_theta);
  }
  return Status::Ok();
}

std::string GpuEngineLacks(const LlamaConfig& config) {
  if (config.qkv_bias || config.o_bias) return "attention biases (attention_bias, or Qwen2's q/k/v biases)";
  if (config.mlp_bias) return "MLP biases (mlp_bias)";
  if (config.explicit_head_dim > 0 && config.explicit_head_dim * config.num_heads != config.hidden_size) {
    return fmt::format("a head_dim of {} other than hidden_size / num_attention_heads ({})", config.explicit_head_dim,
                       config.hidden_size / config.num_heads);
  }
  return "";
}

// ------------------------------------------------------------------ layout

LlamaLayout LayoutOf(const LlamaConfig& config) {
  const int64_t V = config.vocab_size, D = config.hidden_size, I = config.intermediate_size;
  const int64_t q_rows = int64_t(config.num_heads) * config.head_dim();
  const int64_t kv_rows = int64_t(config.num_kv_heads) * config.head_dim();
  LlamaLayout layout;
  Manifest& manifest = layout.manifest;
  layout.embed = manifest.Append("model.embed_tokens.weight", {V, D});
  for (int i = 0; i < config.num_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    // A projection's weight, then its bias where the config has one.
    auto projection = [&](const char* name, int64_t rows, int64_t cols, bool bias, uint64_t* bias_at) {
      const uint64_t at = manifest.Append(p + name + ".weight", {rows, cols});
      if (bias) *bias_at = manifest.Append(p + name + ".bias", {rows});
      return at;
    };
    LlamaLayout::Layer o;
    o.qkv = projection("self_attn.q_proj", q_rows, D, config.qkv_bias, &o.q_bias);
    o.k = projection("self_attn.k_proj", kv_rows, D, config.qkv_bias, &o.k_bias);
    o.v = projection("self_attn.v_proj", kv_rows, D, config.qkv_bias, &o.v_bias);
    o.o = projection("self_attn.o_proj", D, q_rows, config.o_bias, &o.o_bias);
    o.gate_up = projection("mlp.gate_proj", I, D, config.mlp_bias, &o.gate_bias);
    o.up = projection("mlp.up_proj", I, D, config.mlp_bias, &o.up_bias);
    o.down = projection("mlp.down_proj", D, I, config.mlp_bias, &o.down_bias);
    o.input_norm = manifest.Append(p + "input_layernorm.weight", {D});
    o.post_norm = manifest.Append(p + "post_attention_layernorm.weight", {D});
    layout.layers.push_back(o);
  }
  layout.final_norm = manifest.Append("model.norm.weight", {D});
  layout.lm_head = config.tie_embeddings ? layout.embed : manifest.Append("lm_head.weight", {V, D});
  layout.units.push_back({"model.embed_tokens", layout.embed, layout.embed + uint64_t(V * D)});
  for (size_t l = 0; l < layout.layers.size(); ++l) {
    const uint64_t end = l + 1 < layout.layers.size() ? layout.layers[l + 1].qkv : layout.final_norm;
    layout.units.push_back({fmt::format("model.layers.{}", l), layout.layers[l].qkv, end});
  }
  layout.units.push_back({config.tie_embeddings ? "model.norm" : "model.norm+lm_head", layout.final_norm,
                          layout.manifest.total_elements});
  return layout;
}

int64_t TensorCountOf(const LlamaConfig& config) {
  const int64_t per_block = 9 + (config.qkv_bias ? 3 : 0) + (config.o_bias ? 1 : 0) + (config.mlp_bias ? 3 : 0);
  return per_block * int64_t(config.num_layers) + (config.tie_embeddings ? 2 : 3);
}

Llama::Llama(const LlamaConfig& config, int max_batch, bool recompute)
    : config_(config), max_batch_(max_batch), recompute_(recompute) {
  const int64_t V = config.vocab_size, D = config.hidden_size, I = config.intermediate_size;
  const int64_t q_rows = int64_t(config.num_heads) * config.head_dim();
  const int64_t kv_rows = int64_t(config.num_kv_heads) * config.head_dim();
  LlamaLayout layout = LayoutOf(config);
  manifest_ = std::move(layout.manifest);
  const uint64_t embed = layout.embed, final_norm = layout.final_norm, lm_head = layout.lm_head;
  params_ = FlatBuffer<float>(manifest_.total_elements);
  grads_ = FlatBuffer<float>(manifest_.total_elements);
  float* P = params_.data();
  float* G = grads_.data();
  auto linear = [&](int in, int out, uint64_t offset, uint64_t bias = LlamaLayout::kNone) {
    Linear l{in, out};
    l.w = P + offset;
    l.dw = G + offset;
    if (bias != LlamaLayout::kNone) {
      l.b = P + bias;
      l.db = G + bias;
    }
    return l;
  };
  // Without biases the parts are adjacent: one fused Linear, one GEMM.
  auto group = [&](std::initializer_list<Linear> parts) {
    LinearGroup g;
    for (const Linear& p : parts) g.width += p.out;
    const bool biased = std::any_of(parts.begin(), parts.end(), [](const Linear& p) { return p.b != nullptr; });
    if (!biased) {
      g.count = 1;
      g.parts[0] = linear(parts.begin()->in, g.width, uint64_t(parts.begin()->w - P));
      return g;
    }
    for (const Linear& p : parts) g.parts[g.count++] = p;
    return g;
  };
  for (const LlamaLayout::Layer& o : layout.layers) {
    Layer layer;
    layer.qkv = group({linear(int(D), int(q_rows), o.qkv, o.q_bias), linear(int(D), int(kv_rows), o.k, o.k_bias),
                       linear(int(D), int(kv_rows), o.v, o.v_bias)});
    layer.o = linear(int(q_rows), int(D), o.o, o.o_bias);
    layer.gate_up = group({linear(int(D), int(I), o.gate_up, o.gate_bias), linear(int(D), int(I), o.up, o.up_bias)});
    layer.down = linear(int(I), int(D), o.down, o.down_bias);
    layer.input_norm = P + o.input_norm;
    layer.d_input_norm = G + o.input_norm;
    layer.post_norm = P + o.post_norm;
    layer.d_post_norm = G + o.post_norm;
    layers_.push_back(layer);
  }
  embed_ = P + embed;
  d_embed_ = G + embed;
  final_norm_ = P + final_norm;
  d_final_norm_ = G + final_norm;
  lm_head_ = linear(int(D), int(V), lm_head);

  units_ = layout.units;

  rope_cos_.resize(size_t(config.max_seq_len) * config.head_dim() / 2);
  rope_sin_.resize(rope_cos_.size());
  RopeTables(config.max_seq_len, config.head_dim() / 2, config.RopeInverseFrequencies().data(), rope_cos_.data(),
             rope_sin_.data());

  acts_.layers.resize(config.num_layers);
  // Fresh pages, not a zeroed vector: a vector would make the whole arena
  // resident at once, however short the sequences trained.
  arena_ = FlatBuffer<float>(Carve(max_batch, config.max_seq_len, nullptr));
}

Result<Llama> Llama::Create(const LlamaConfig& config, int max_batch, bool recompute) {
  ESTUARY_RETURN_IF_ERROR(config.Validate());
  if (max_batch <= 0 || int64_t(max_batch) * config.max_seq_len > INT_MAX / 2) {
    return InvalidArgument("llama: max_batch {} with max_seq_len {} is out of range", max_batch,
                           config.max_seq_len);
  }
  return Llama(config, max_batch, recompute);
}

// Hands out consecutive slices of a buffer, each rounded up to 16 floats so
// every slice starts 64-byte aligned relative to the base.
class Carver {
 public:
  explicit Carver(float* base) : base_(base) {}
  float* Take(int64_t count) {
    float* p = base_ ? base_ + used_ : nullptr;
    used_ += (size_t(count) + 15) / 16 * 16;
    return p;
  }
  size_t used() const { return used_; }

 private:
  float* base_;
  size_t used_ = 0;
};

size_t Llama::Carve(int batch, int seq, float* base) {
  const LlamaConfig& c = config_;
  const int64_t n = int64_t(batch) * seq, D = c.hidden_size, V = c.vocab_size, I = c.intermediate_size;
  const int64_t hd = c.head_dim(), H = c.num_heads, KV = c.num_kv_heads;
  Carver carver(base);
  const int64_t resid_block = (n * D + 15) / 16 * 16;
  acts_.resid = carver.Take(resid_block * (c.num_layers + 1));
  acts_.resid_stride = size_t(resid_block);
  for (LayerActivations& a : acts_.layers) {
    if (recompute_ && &a != &acts_.layers[0]) {
      a = acts_.layers[0];  // one region, which each block's forward overwrites
      continue;
    }
    a.rstd1 = carver.Take(n);
    a.xn1 = carver.Take(n * D);
    a.qkv = carver.Take(n * (H + 2 * KV) * hd);
    a.probs = carver.Take(int64_t(batch) * H * seq * seq);
    a.attn = carver.Take(n * H * hd);
    a.h = carver.Take(n * D);
    a.rstd2 = carver.Take(n);
    a.xn2 = carver.Take(n * D);
    a.gate_up = carver.Take(n * 2 * I);
    a.act = carver.Take(n * I);
  }
  acts_.rstd_final = carver.Take(n);
  acts_.xn_final = carver.Take(n * D);
  acts_.logits = carver.Take(n * V);
  acts_.dresid = carver.Take(n * D);
  acts_.dxn = carver.Take(n * D);
  acts_.dqkv = carver.Take(n * (H + 2 * KV) * hd);
  acts_.dattn = carver.Take(n * H * hd);
  acts_.dscores = carver.Take(int64_t(seq) * seq);
  acts_.dgate_up = carver.Take(n * 2 * I);
  acts_.dact = carver.Take(n * I);
  return carver.used();
}

// ---------------------------------------------------------------- training

void InitializeLlamaParameters(const Manifest& manifest, uint64_t seed, std::span<float> params) {
  assert(params.size() == manifest.total_elements);
  std::mt19937_64 rng(seed);
  // 53 random bits -> a double in (0, 1), never 0, so the log below is finite.
  auto uniform = [&rng] { return (double(rng() >> 11) + 0.5) * 0x1.0p-53; };
  for (const TensorSpec& t : manifest.tensors) {
    float* p = params.data() + t.offset;
    const uint64_t count = t.numel();
    if (t.shape.size() == 1) {
      std::fill(p, p + count, 1.0f);
      continue;
    }
    // Box-Muller: one pair of uniforms gives two normals.
    for (uint64_t i = 0; i < count; i += 2) {
      const double r = 0.02 * std::sqrt(-2.0 * std::log(uniform())), angle = 2.0 * std::numbers::pi * uniform();
      p[i] = float(r * std::cos(angle));
      if (i + 1 < count) p[i + 1] = float(r * std::sin(angle));
    }
  }
}

void Llama::Initialize(uint64_t seed) { InitializeLlamaParameters(manifest_, seed, params_); }

Status Llama::CheckInput(const int32_t* tokens, const int32_t* targets, int batch, int seq) const {
  if (batch < 1 || batch > max_batch_) {
    return InvalidArgument("llama: batch {} is outside [1, {}] (max_batch given at Create)", batch, max_batch_);
  }
  if (seq < 1 || seq > config_.max_seq_len) {
    return InvalidArgument("llama: sequence length {} is outside [1, {}] (max_seq_len)", seq, config_.max_seq_len);
  }
  auto check = [&](const char* what, const int32_t* ids, bool may_ignore) -> Status {
    for (int64_t i = 0; i < int64_t(batch) * seq; ++i) {
      if (may_ignore && ids[i] == kIgnoredTarget) continue;
      if (ids[i] < 0 || ids[i] >= config_.vocab_size) {
        return InvalidArgument("llama: {} id {} at batch {}, position {} is outside the vocabulary [0, {})", what,
                               ids[i], i / seq, i % seq, config_.vocab_size);
      }
    }
    return Status::Ok();
  };
  if (!tokens) return InvalidArgument("llama: no token ids given");
  ESTUARY_RETURN_IF_ERROR(check("token", tokens, false));
  if (targets) ESTUARY_RETURN_IF_ERROR(check("target", targets, true));
  return Status::Ok();
}

void Llama::ForwardBlock(int l, int batch, int seq, bool to_output) {
  const LlamaConfig& c = config_;
  const int n = batch * seq, D = c.hidden_size, I = c.intermediate_size, hd = c.head_dim();
  const int H = c.num_heads, KV = c.num_kv_heads;
  const int64_t qkv_width = int64_t(H + 2 * KV) * hd;
  const float eps = float(c.rms_norm_eps);
  const Layer& layer = layers_[l];
  const LayerActivations& a = acts_.layers[l];
  const float* x = acts_.resid + l * acts_.resid_stride;
  RmsNormForward(x, layer.input_norm, n, D, eps, a.xn1, a.rstd1);
  layer.qkv.Forward(a.xn1, n, a.qkv);
  RopeForward(a.qkv, batch, seq, H, hd, qkv_width, rope_cos_.data(), rope_sin_.data());
  RopeForward(a.qkv + int64_t(H) * hd, batch, seq, KV, hd, qkv_width, rope_cos_.data(), rope_sin_.data());
  AttentionForward(a.qkv, batch, seq, H, KV, hd, a.probs, a.attn);
  layer.o.Forward(a.attn, n, a.h);
  ResidualAdd(x, int64_t(n) * D, a.h);
  RmsNormForward(a.h, layer.post_norm, n, D, eps, a.xn2, a.rstd2);
  layer.gate_up.Forward(a.xn2, n, a.gate_up);
  SwiGluForward(a.gate_up, n, I, a.act);
  // The residual (out += h) is the caller's, after the unit's AfterUnit.
  if (to_output) layer.down.Forward(a.act, n, acts_.resid + (l + 1) * acts_.resid_stride);
}

// Units: 0 the embedding, 1 + l block l, L + 1 the final norm (+ LM head).
void Llama::RunForward(const int32_t* tokens, int batch, int seq, float* logits, StepHooks& hooks) {
  const LlamaConfig& c = config_;
  const int n = batch * seq, D = c.hidden_size;
  const float eps = float(c.rms_norm_eps);
  const int final_unit = c.num_layers + 1;
  hooks.BeforeUnit(0, Pass::kForward);
  EmbeddingForward(tokens, n, embed_, D, acts_.resid);
  hooks.AfterUnit(0, Pass::kForward);
  for (int l = 0; l < c.num_layers; ++l) {
    hooks.BeforeUnit(1 + l, Pass::kForward);
    ForwardBlock(l, batch, seq, /*to_output=*/true);
    hooks.AfterUnit(1 + l, Pass::kForward);
    const LayerActivations& a = acts_.layers[l];
    ResidualAdd(a.h, int64_t(n) * D, acts_.resid + (l + 1) * acts_.resid_stride);
  }
  hooks.BeforeUnit(final_unit, Pass::kForward);
  RmsNormForward(acts_.resid + c.num_layers * acts_.resid_stride, final_norm_, n, D, eps, acts_.xn_final,
                 acts_.rstd_final);
  if (c.tie_embeddings) {
    hooks.AfterUnit(final_unit, Pass::kForward);
    hooks.BeforeUnit(0, Pass::kForward);
    lm_head_.Forward(acts_.xn_final, n, logits);
    hooks.AfterUnit(0, Pass::kForward);
  } else {
    lm_head_.Forward(acts_.xn_final, n, logits);
    hooks.AfterUnit(final_unit, Pass::kForward);
  }
}

Status Llama::Forward(const int32_t* tokens, int batch, int seq, float* logits) {
  ESTUARY_RETURN_IF_ERROR(CheckInput(tokens, nullptr, batch, seq));
  if (!logits) return InvalidArgument("llama: no logits buffer given");
  Carve(batch, seq, arena_.data());
  RunForward(tokens, batch, seq, logits, StepHooks::None());
  return Status::Ok();
}

Result<float> Llama::ForwardBackward(const int32_t* tokens, const int32_t* targets, int batch, int seq,
                                     const BackwardOptions& options) {
  if (!targets) return InvalidArgument("llama: no target ids given");
  ESTUARY_RETURN_IF_ERROR(CheckInput(tokens, targets, batch, seq));
  if (!std::isfinite(options.grad_scale)) {
    return InvalidArgument("llama: grad_scale {} is not finite", options.grad_scale);
  }
  StepHooks& hooks = options.hooks ? *options.hooks : StepHooks::None();
  const bool accumulate = options.accumulate;
  const LlamaConfig& c = config_;
  const int n = batch * seq, D = c.hidden_size, I = c.intermediate_size, hd = c.head_dim();
  const int H = c.num_heads, KV = c.num_kv_heads;
  const int64_t qkv_width = int64_t(H + 2 * KV) * hd;
  const int final_unit = c.num_layers + 1;
  Carve(batch, seq, arena_.data());
  const Activations& a = acts_;
  RunForward(tokens, batch, seq, a.logits, hooks);
  float* dlogits = a.logits;  // in place: the logits are not needed again
  const float loss = CrossEntropyForwardBackward(a.logits, targets, n, c.vocab_size, dlogits, options.grad_scale);

  // The LM head first: when tied, it writes (or adds to) the embedding's
  // gradient, to which the input side is added last; so unit 0's gradient is
  // final only at the very end.
  if (c.tie_embeddings) {
    hooks.BeforeUnit(0, Pass::kBackward);
    lm_head_.Backward(a.xn_final, dlogits, n, a.dxn, accumulate);
    hooks.AfterUnit(0, Pass::kBackward);
    hooks.BeforeUnit(final_unit, Pass::kBackward);
  } else {
    hooks.BeforeUnit(final_unit, Pass::kBackward);
    lm_head_.Backward(a.xn_final, dlogits, n, a.dxn, accumulate);
    hooks.GradientsFinal(uint64_t(lm_head_.dw - grads_.data()));  // the LM head lies after the final norm
  }
  std::memset(a.dresid, 0, sizeof(float) * n * D);
  RmsNormBackward(a.resid + c.num_layers * a.resid_stride, final_norm_, a.rstd_final, a.dxn, n, D, a.dresid,
                  d_final_norm_, accumulate);
  hooks.AfterUnit(final_unit, Pass::kBackward);
  hooks.GradientsFinal(units_[final_unit].begin);
  // dresid holds dL/d(output of block l) on entry and dL/d(its input) on exit.
  for (int l = c.num_layers - 1; l >= 0; --l) {
    hooks.BeforeUnit(1 + l, Pass::kBackward);
    // The last block's activations are still those of the forward pass.
    if (recompute_ && l + 1 < c.num_layers) ForwardBlock(l, batch, seq, /*to_output=*/false);
    const Layer& layer = layers_[l];
    const LayerActivations& s = a.layers[l];
    layer.down.Backward(s.act, a.dresid, n, a.dact, accumulate);
    SwiGluBackward(s.gate_up, a.dact, n, I, a.dgate_up);
    layer.gate_up.Backward(s.xn2, a.dgate_up, n, a.dxn, accumulate);
    RmsNormBackward(s.h, layer.post_norm, s.rstd2, a.dxn, n, D, a.dresid, layer.d_post_norm, accumulate);
    layer.o.Backward(s.attn, a.dresid, n, a.dattn, accumulate);
    AttentionBackward(s.qkv, s.probs, a.dattn, batch, seq, H, KV, hd, a.dscores, a.dqkv);
    RopeBackward(a.dqkv, batch, seq, H, hd, qkv_width, rope_cos_.data(), rope_sin_.data());
    RopeBackward(a.dqkv + int64_t(H) * hd, batch, seq, KV, hd, qkv_width, rope_cos_.data(), rope_sin_.data());
    layer.qkv.Backward(s.xn1, a.dqkv, n, a.dxn, accumulate);
    RmsNormBackward(a.resid + l * a.resid_stride, layer.input_norm, s.rstd1, a.dxn, n, D, a.dresid,
                    layer.d_input_norm, accumulate);
    hooks.AfterUnit(1 + l, Pass::kBackward);
    hooks.GradientsFinal(units_[1 + l].begin);
  }
  // The lookup's backward reads no weight: no unit.
  if (!c.tie_embeddings && !accumulate) std::memset(d_embed_, 0, sizeof(float) * int64_t(c.vocab_size) * D);
  EmbeddingBackward(tokens, n, a.dresid, D, d_embed_);
  hooks.GradientsFinal(0);
  return loss;
}

}  // namespace estuary::models
