#include "models/cuda/llama_decoder.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cmath>

#include "models/cuda/check.h"
#include "models/cuda/decode_kernels.h"
#include "models/cuda/llama_engine_impl.h"
#include "models/cuda/transformer.h"

namespace estuary::models::cuda {

static_assert(int(internal::Kind::kF32) == int(DType::kF32) && int(internal::Kind::kBF16) == int(DType::kBF16) &&
              int(internal::Kind::kF16) == int(DType::kF16));

struct LlamaDecoder::Impl {
  // The engine's Impl, which stays where it is when the engine moves.
  LlamaEngine::Impl* e = nullptr;
  int capacity = 0, length = 0, reserved_rows = 0;
  std::string device;
  DeviceBuffer keys, values;  // [layers, kv_heads, capacity, head_dim] each, in the activation dtype
  DeviceBuffer logits;        // [vocab] fp32
  // One pass's buffers for up to reserved_rows tokens, carved from `pass`.
  DeviceBuffer pass;
  int32_t* ids = nullptr;
  float *x = nullptr, *h = nullptr, *rstd = nullptr;
  void *xn = nullptr, *qkv = nullptr, *attn = nullptr, *gate_up = nullptr, *act = nullptr;

  const LlamaConfig& config() const { return e->config; }
  size_t CacheOffset(int layer) const {  // elements to layer `layer`'s block of the cache
    const LlamaConfig& c = config();
    return size_t(layer) * c.num_kv_heads * capacity * c.head_dim();
  }
  void* Keys(int layer) const { return keys.as<char>() + CacheOffset(layer) * DTypeSize(e->act()); }
  void* Values(int layer) const { return values.as<char>() + CacheOffset(layer) * DTypeSize(e->act()); }

  // Carves the per-pass buffers for `rows` tokens (with a null base: measures).
  size_t Carve(int rows, char* base) {
    const LlamaConfig& c = config();
    const int64_t n = rows, D = c.hidden_size, I = c.intermediate_size, hd = c.head_dim();
    const size_t a = DTypeSize(e->act());
    Carver carver(base);
    ids = carver.Ints(n);
    x = carver.Floats(n * D);
    h = carver.Floats(n * D);
    rstd = carver.Floats(n);
    xn = carver.Take(n * D, a);
    qkv = carver.Take(n * (c.num_heads + 2 * c.num_kv_heads) * hd, a);
    attn = carver.Take(n * c.num_heads * hd, a);
    gate_up = carver.Take(n * 2 * I, a);
    act = carver.Take(n * I, a);
    return carver.used();
  }
  // Grows the per-pass buffers to `rows` tokens. Freeing the old buffer
  // waits for the device (cudaFree), so no enqueued kernel still reads it.
  Status Reserve(int rows) {
    if (rows <= reserved_rows) return Status::Ok();
    pass = DeviceBuffer();
    reserved_rows = 0;
    ESTUARY_ASSIGN_OR_RETURN(pass, DeviceBuffer::Allocate(Carve(rows, nullptr)));
    Carve(rows, pass.as<char>());
    reserved_rows = rows;
    return Status::Ok();
  }

  Status Run(int rows);
  Status Attend(int layer, int rows);
};

Result<LlamaDecoder> LlamaDecoder::Create(LlamaEngine& engine, int capacity) {
  LlamaEngine::Impl& e = engine.impl();
  const LlamaConfig& c = e.config;
  if (capacity == 0) capacity = c.max_seq_len;
  if (capacity < 1 || capacity > c.max_seq_len) {
    return InvalidArgument("cuda kv cache: capacity {} is outside [1, {}] (max_seq_len)", capacity, c.max_seq_len);
  }
  if (c.head_dim() > internal::kDecodeMaxHeadDim) {
    return InvalidArgument("cuda kv cache: head_dim {} is above the {} the decode attention kernel holds",
                           c.head_dim(), internal::kDecodeMaxHeadDim);
  }
  auto impl = std::make_unique<Impl>();
  impl->e = &e;
  impl->capacity = capacity;
  int ordinal = 0;
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaGetDevice(&ordinal));
  cudaDeviceProp prop{};
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, ordinal));
  impl->device = fmt::format("cuda:{} ({}) {}", ordinal, prop.name, DTypeName(e.act()));
  const size_t cache = impl->CacheOffset(c.num_layers) * DTypeSize(e.act());
  ESTUARY_ASSIGN_OR_RETURN(impl->keys, DeviceBuffer::Allocate(cache));
  ESTUARY_ASSIGN_OR_RETURN(impl->values, DeviceBuffer::Allocate(cache));
  ESTUARY_ASSIGN_OR_RETURN(impl->logits, DeviceBuffer::Allocate(size_t(c.vocab_size) * sizeof(float)));
  return LlamaDecoder(std::move(impl));
}

LlamaDecoder::LlamaDecoder(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LlamaDecoder::LlamaDecoder(LlamaDecoder&&) noexcept = default;
LlamaDecoder& LlamaDecoder::operator=(LlamaDecoder&&) noexcept = default;
LlamaDecoder::~LlamaDecoder() = default;

int LlamaDecoder::vocab_size() const { return impl_->config().vocab_size; }
int LlamaDecoder::length() const { return impl_->length; }
int LlamaDecoder::capacity() const { return impl_->capacity; }
void LlamaDecoder::Clear() { impl_->length = 0; }
std::string LlamaDecoder::device() const { return impl_->device; }
size_t LlamaDecoder::cache_bytes() const { return impl_->keys.size() + impl_->values.size(); }

// The pass's keys and values into the cache at positions length on, then
// every query row's attention over the cache up to its own position.
Status LlamaDecoder::Impl::Attend(int layer, int rows) {
  const LlamaConfig& c = config();
  const int hd = c.head_dim(), H = c.num_heads, KV = c.num_kv_heads;
  const internal::Kind kind = internal::Kind(e->act());
  ESTUARY_CUDA_RETURN_IF_ERROR(
      internal::AppendKv(qkv, kind, rows, H, KV, hd, capacity, length, Keys(layer), Values(layer), e->s()));
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::DecodeAttention(qkv, Keys(layer), Values(layer), kind, rows, H, KV, hd,
                                                         capacity, length, 1.0f / std::sqrt(float(hd)), attn,
                                                         e->s()));
  return Status::Ok();
}

// LlamaEngine::Impl::RunForward for `rows` tokens (ids already uploaded) at
// positions length ... length + rows - 1: the same ops on the same weights,
// with attention over the cache, and the final norm and LM head on the last
// row only.
Status LlamaDecoder::Impl::Run(int rows) {
  LlamaEngine::Impl& m = *e;
  const LlamaConfig& c = config();
  const int n = rows, D = c.hidden_size, I = c.intermediate_size, hd = c.head_dim(), V = c.vocab_size;
  const int H = c.num_heads, KV = c.num_kv_heads;
  const int64_t qkv_width = int64_t(H + 2 * KV) * hd, half = hd / 2;
  const float eps = float(c.rms_norm_eps);
  const DType a = m.act();
  cudaStream_t s = m.s();
  // Token t of this pass has position length + t: the RoPE tables from row `length` on.
  const float* cos = m.rope_cos() + int64_t(length) * half;
  const float* sin = m.rope_sin() + int64_t(length) * half;
  if (m.master()) {
    ESTUARY_RETURN_IF_ERROR(EmbeddingForward(ids, n, m.P() + m.embed, V, D, x, s));
  } else {
    ESTUARY_RETURN_IF_ERROR(EmbeddingForward(ids, n, m.W(m.embed), a, V, D, x, s));
  }
  for (int l = 0; l < c.num_layers; ++l) {
    const LlamaEngine::Impl::LayerOffsets& o = m.offsets[l];
    ESTUARY_RETURN_IF_ERROR(RmsNormForward(x, m.Norm(o.input_norm), n, D, eps, xn, a, rstd, s));
    ESTUARY_RETURN_IF_ERROR(
        Gemm(m.blas, false, true, n, qkv_width, D, 1.0f, xn, D, m.W(o.qkv), D, 0.0f, qkv, qkv_width, m.Same()));
    ESTUARY_RETURN_IF_ERROR(m.AdaptForward(l, Projection::kQkv, xn, n, qkv, a));
    ESTUARY_RETURN_IF_ERROR(RopeForward(qkv, a, 1, n, H + KV, hd, qkv_width, cos, sin, s));
    ESTUARY_RETURN_IF_ERROR(Attend(l, n));
    ESTUARY_RETURN_IF_ERROR(Gemm(m.blas, false, true, n, D, int64_t(H) * hd, 1.0f, attn, int64_t(H) * hd, m.W(o.o),
                                 int64_t(H) * hd, 0.0f, h, D, m.ToF32()));
    ESTUARY_RETURN_IF_ERROR(m.AdaptForward(l, Projection::kO, attn, n, h, DType::kF32));
    ESTUARY_RETURN_IF_ERROR(ResidualAdd(x, int64_t(n) * D, h, s));
    ESTUARY_RETURN_IF_ERROR(RmsNormForward(h, m.Norm(o.post_norm), n, D, eps, xn, a, rstd, s));
    ESTUARY_RETURN_IF_ERROR(Gemm(m.blas, false, true, n, 2 * int64_t(I), D, 1.0f, xn, D, m.W(o.gate_up), D, 0.0f,
                                 gate_up, 2 * I, m.Same()));
    ESTUARY_RETURN_IF_ERROR(m.AdaptForward(l, Projection::kGateUp, xn, n, gate_up, a));
    ESTUARY_RETURN_IF_ERROR(SwiGluForward(gate_up, n, I, act, a, s));
    // The block's output overwrites x, which h already holds added in.
    ESTUARY_RETURN_IF_ERROR(
        Gemm(m.blas, false, true, n, D, I, 1.0f, act, I, m.W(o.down), I, 0.0f, x, D, m.ToF32()));
    ESTUARY_RETURN_IF_ERROR(m.AdaptForward(l, Projection::kDown, act, n, x, DType::kF32));
    ESTUARY_RETURN_IF_ERROR(ResidualAdd(h, int64_t(n) * D, x, s));
  }
  const float* last = x + int64_t(n - 1) * D;
  ESTUARY_RETURN_IF_ERROR(RmsNormForward(last, m.Norm(m.final_norm), 1, D, eps, xn, a, rstd, s));
  return Gemm(m.blas, false, true, 1, V, D, 1.0f, xn, D, m.W(m.lm_head), D, 0.0f, logits.as<float>(), V, m.ToF32());
}

Status LlamaDecoder::Append(std::span<const int32_t> tokens, std::span<float> logits) {
  Impl& d = *impl_;
  const LlamaConfig& c = d.config();
  const int past = d.length;
  if (tokens.empty()) return InvalidArgument("cuda kv cache: no tokens to append");
  if (tokens.size() > size_t(d.capacity - past)) {
    return InvalidArgument("cuda kv cache: {} cached + {} new positions exceed the capacity {}", past, tokens.size(),
                           d.capacity);
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size) {
      return InvalidArgument("cuda kv cache: token id {} at index {} is outside the vocabulary [0, {})", tokens[i], i,
                             c.vocab_size);
    }
  }
  if (logits.size() < size_t(c.vocab_size)) {
    return InvalidArgument("cuda kv cache: a logits span of {} floats for a vocabulary of {}", logits.size(),
                           c.vocab_size);
  }
  const int rows = int(tokens.size());
  ESTUARY_RETURN_IF_ERROR(d.Reserve(rows));
  ESTUARY_RETURN_IF_ERROR(CopyToDevice(d.ids, tokens.data(), tokens.size() * sizeof(int32_t), d.e->s()));
  ESTUARY_RETURN_IF_ERROR(d.Run(rows));
  ESTUARY_RETURN_IF_ERROR(
      CopyToHost(logits.data(), d.logits.data(), size_t(c.vocab_size) * sizeof(float), d.e->s()));
  d.length = past + rows;
  return Status::Ok();
}

}  // namespace estuary::models::cuda
