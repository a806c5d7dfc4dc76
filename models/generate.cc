#include "models/generate.h"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "models/transformer_ops.h"

namespace estuary::models {

KvCacheDecoder::KvCacheDecoder(const Llama& model, int capacity) : model_(&model), capacity_(capacity) {
  const LlamaConfig& c = model.config();
  const size_t cache = size_t(c.num_layers) * c.num_kv_heads * capacity * c.head_dim();
  keys_.resize(cache);
  values_.resize(cache);
}

Result<KvCacheDecoder> KvCacheDecoder::Create(const Llama& model, int capacity) {
  const int max_seq_len = model.config().max_seq_len;
  if (capacity == 0) capacity = max_seq_len;
  if (capacity < 1 || capacity > max_seq_len) {
    return InvalidArgument("kv cache: capacity {} is outside [1, {}] (max_seq_len)", capacity, max_seq_len);
  }
  return KvCacheDecoder(model, capacity);
}

size_t KvCacheDecoder::CacheOffset(int layer, int kv_head) const {
  const LlamaConfig& c = model_->config();
  return (size_t(layer) * c.num_kv_heads + kv_head) * capacity_ * c.head_dim();
}

void KvCacheDecoder::Reserve(int rows) {
  if (rows <= reserved_rows_) return;
  const LlamaConfig& c = model_->config();
  const size_t n = rows, D = c.hidden_size, I = c.intermediate_size, hd = c.head_dim();
  x_.resize(n * D);
  xn_.resize(n * D);
  rstd_.resize(n);
  qkv_.resize(n * (c.num_heads + 2 * c.num_kv_heads) * hd);
  scores_.resize(n * capacity_);
  attn_.resize(n * c.num_heads * hd);
  h_.resize(n * D);
  gate_up_.resize(n * 2 * I);
  act_.resize(n * I);
  reserved_rows_ = rows;
}

// Linear::Forward (the same bias and product) for a pass of `rows` tokens,
// with one row through GEMV: OpenBLAS packs a GEMM's whole weight matrix even
// for one row, which doubles the bytes a decode step moves.
static void Project(const Linear& linear, const float* x, int rows, float* y) {
  if (rows > 1) return linear.Forward(x, rows, y);
  if (linear.b) std::memcpy(y, linear.b, sizeof(float) * linear.out);
  cblas_sgemv(CblasRowMajor, CblasNoTrans, linear.out, linear.in, 1.0f, linear.w, linear.in, x, 1,
              linear.b ? 1.0f : 0.0f, y, 1);
}

// Caches the pass's keys and values (qkv_ after RoPE) at positions length_
// on, then runs AttentionForward's steps for each query head over every
// cached position: scores, a causal softmax (token t sees positions up to
// length_ + t), the weighted values into attn_.
void KvCacheDecoder::Attend(int layer, int rows) {
  const LlamaConfig& c = model_->config();
  const int hd = c.head_dim(), H = c.num_heads, KV = c.num_kv_heads, group = H / KV;
  const int past = length_, length = past + rows;
  const int64_t qkv_width = int64_t(H + 2 * KV) * hd, attn_width = int64_t(H) * hd;
  const float scale = 1.0f / std::sqrt(float(hd));
  for (int g = 0; g < KV; ++g) {
    float* keys = Keys(layer, g);
    float* values = Values(layer, g);
    for (int t = 0; t < rows; ++t) {
      const float* row = qkv_.data() + t * qkv_width;
      std::memcpy(keys + int64_t(past + t) * hd, row + int64_t(H + g) * hd, sizeof(float) * hd);
      std::memcpy(values + int64_t(past + t) * hd, row + int64_t(H + KV + g) * hd, sizeof(float) * hd);
    }
  }
  for (int h = 0; h < H; ++h) {
    const float* keys = Keys(layer, h / group);
    const float* values = Values(layer, h / group);
    float* p = scores_.data();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, length, hd, scale, qkv_.data() + int64_t(h) * hd,
                int(qkv_width), keys, hd, 0.0f, p, length);
    for (int t = 0; t < rows; ++t) {
      float* row = p + int64_t(t) * length;
      const int last = past + t;
      float max = row[0];
      for (int j = 1; j <= last; ++j) max = row[j] > max ? row[j] : max;
      // As AttentionForward (models/transformer_ops.cc) computes it.
      for (int j = 0; j <= last; ++j) row[j] = VectorExp(row[j] - max);
      float sum = 0;
      for (int j = 0; j <= last; ++j) sum += row[j];
      const float inv = 1.0f / sum;
      for (int j = 0; j <= last; ++j) row[j] *= inv;
      for (int j = last + 1; j < length; ++j) row[j] = 0.0f;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hd, length, 1.0f, p, length, values, hd, 0.0f,
                attn_.data() + int64_t(h) * hd, int(attn_width));
  }
}

// LinearGroup::Forward likewise: one row's parts each write their slice.
static void Project(const LinearGroup& group, const float* x, int rows, float* y) {
  if (rows > 1) return group.Forward(x, rows, y);
  int column = 0;
  for (int k = 0; k < group.count; ++k) {
    Project(group.parts[k], x, 1, y + column);
    column += group.parts[k].out;
  }
}

// Llama::RunForward for rows at positions past ... past + rows - 1, with the
// attention reading keys and values from the cache. Each op is the one the
// full forward calls, in the same order (a single row's projections as GEMV),
// so the two agree to the rounding of the matrix products.
Status KvCacheDecoder::Append(std::span<const int32_t> tokens, std::span<float> logits) {
  const Llama& m = *model_;
  const LlamaConfig& c = m.config();
  const int past = length_;
  if (tokens.empty()) return InvalidArgument("kv cache: no tokens to append");
  if (tokens.size() > size_t(capacity_ - past)) {
    return InvalidArgument("kv cache: {} cached + {} new positions exceed the capacity {}", past, tokens.size(),
                           capacity_);
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size) {
      return InvalidArgument("kv cache: token id {} at index {} is outside the vocabulary [0, {})", tokens[i], i,
                             c.vocab_size);
    }
  }
  if (logits.size() < size_t(c.vocab_size)) {
    return InvalidArgument("kv cache: a logits span of {} floats for a vocabulary of {}", logits.size(),
                           c.vocab_size);
  }
  const int rows = int(tokens.size());
  Reserve(rows);
  const int D = c.hidden_size, I = c.intermediate_size, hd = c.head_dim(), H = c.num_heads, KV = c.num_kv_heads;
  const int64_t qkv_width = int64_t(H + 2 * KV) * hd;
  const int half = hd / 2;
  const float eps = float(c.rms_norm_eps);
  // Token t of this pass has position past + t: the tables from row `past` on.
  const float* cos = m.rope_cos_.data() + int64_t(past) * half;
  const float* sin = m.rope_sin_.data() + int64_t(past) * half;

  EmbeddingForward(tokens.data(), rows, m.embed_, D, x_.data());
  for (int l = 0; l < c.num_layers; ++l) {
    const Llama::Layer& layer = m.layers_[l];
    RmsNormForward(x_.data(), layer.input_norm, rows, D, eps, xn_.data(), rstd_.data());
    Project(layer.qkv, xn_.data(), rows, qkv_.data());
    RopeForward(qkv_.data(), 1, rows, H, hd, qkv_width, cos, sin);
    RopeForward(qkv_.data() + int64_t(H) * hd, 1, rows, KV, hd, qkv_width, cos, sin);
    Attend(l, rows);
    Project(layer.o, attn_.data(), rows, h_.data());
    ResidualAdd(x_.data(), int64_t(rows) * D, h_.data());
    RmsNormForward(h_.data(), layer.post_norm, rows, D, eps, xn_.data(), rstd_.data());
    Project(layer.gate_up, xn_.data(), rows, gate_up_.data());
    SwiGluForward(gate_up_.data(), rows, I, act_.data());
    Project(layer.down, act_.data(), rows, x_.data());
    ResidualAdd(h_.data(), int64_t(rows) * D, x_.data());
  }
  // Only the last token's logits are wanted: the final norm and the LM head
  // on one row.
  const float* last = x_.data() + int64_t(rows - 1) * D;
  RmsNormForward(last, m.final_norm_, 1, D, eps, xn_.data(), rstd_.data());
  Project(m.lm_head_, xn_.data(), 1, logits.data());
  length_ = past + rows;
  return Status::Ok();
}

// The checks every Generate makes, against a context of `context` positions.
static Status CheckGenerate(std::span<const int32_t> prompt, const GenerateOptions& options, int context,
                            int64_t* positions) {
  ESTUARY_RETURN_IF_ERROR(options.sampling.Validate());
  if (prompt.empty()) return InvalidArgument("generate: the prompt holds no tokens");
  if (options.max_new_tokens < 0) {
    return InvalidArgument("generate: max_new_tokens {} must be >= 0", options.max_new_tokens);
  }
  // The last new token is never fed back, so it needs no position.
  *positions = int64_t(prompt.size()) + std::max(options.max_new_tokens - 1, 0);
  if (*positions > context) {
    return InvalidArgument("generate: a prompt of {} tokens and {} new ones exceed the context of {}", prompt.size(),
                           options.max_new_tokens, context);
  }
  return Status::Ok();
}

Result<Generation> Generate(const Llama& model, std::span<const int32_t> prompt, const GenerateOptions& options) {
  int64_t positions = 0;
  ESTUARY_RETURN_IF_ERROR(CheckGenerate(prompt, options, model.config().max_seq_len, &positions));
  ESTUARY_ASSIGN_OR_RETURN(KvCacheDecoder decoder, KvCacheDecoder::Create(model, int(positions)));
  return Generate(decoder, prompt, options);
}

Result<Generation> Generate(TokenDecoder& decoder, std::span<const int32_t> prompt, const GenerateOptions& options) {
  int64_t positions = 0;
  ESTUARY_RETURN_IF_ERROR(CheckGenerate(prompt, options, decoder.capacity(), &positions));
  decoder.Clear();
  std::vector<float> logits(decoder.vocab_size());
  ESTUARY_RETURN_IF_ERROR(decoder.Append(prompt, logits));
  Generation out;
  TokenSampler sampler(options.sampling);
  for (int step = 0; step < options.max_new_tokens; ++step) {
    if (step > 0) ESTUARY_RETURN_IF_ERROR(decoder.Append(std::span(&out.tokens.back(), 1), logits));
    const int32_t token = sampler.Next(logits);
    out.tokens.push_back(token);
    out.log_probs.push_back(LogSoftmaxAt(logits, token));
    if (std::find(options.stop_tokens.begin(), options.stop_tokens.end(), token) != options.stop_tokens.end()) {
      out.stopped = true;
      break;
    }
  }
  return out;
}

}  // namespace estuary::models
