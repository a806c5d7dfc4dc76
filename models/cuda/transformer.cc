#include "models/cuda/transformer.h"

#include <climits>
#include <cmath>

#include "models/cuda/check.h"
#include "models/cuda/kernels.h"
#include "models/cuda/sizes.h"
#include "models/cuda/transformer_kernels.h"

namespace estuary::models::cuda {
namespace {

using internal::IsAligned;
using internal::Kind;

Kind KindOf(DType dtype) { return Kind(dtype); }

// Four elements per access need 16 bytes of fp32 or 8 of a 16-bit type.
bool VectorAligned(const void* p, DType dtype) { return IsAligned(p, dtype == DType::kF32 ? 16 : 8); }

Status CheckRows(const char* what, int n, int dim) {
  if (n < 0 || dim < 1 || CheckedProduct({n, dim}) < 0) {
    return InvalidArgument("{}: needs n >= 0 rows of dim >= 1, got n={} dim={}", what, n, dim);
  }
  return Status::Ok();
}

Status CheckAttention(const char* what, int batch, int seq, int heads, int kv_heads, int head_dim) {
  if (batch < 1 || seq < 1 || heads < 1 || kv_heads < 1 || head_dim < 1 || heads % kv_heads != 0) {
    return InvalidArgument("{}: batch={} seq={} heads={} kv_heads={} head_dim={}: every size must be positive and "
                           "kv_heads divide heads", what, batch, seq, heads, kv_heads, head_dim);
  }
  // Element counts of qkv and of the [batch, heads, seq, seq] scores.
  if (CheckedProduct({batch, seq, heads + 2 * int64_t(kv_heads), head_dim}) < 0 ||
      CheckedProduct({batch, heads, seq, seq}) < 0 || int64_t(heads + 2 * int64_t(kv_heads)) * head_dim > INT_MAX) {
    return InvalidArgument("{}: batch={} seq={} heads={} kv_heads={} head_dim={} overflows", what, batch, seq, heads,
                           kv_heads, head_dim);
  }
  return Status::Ok();
}

}  // namespace

// ---------------------------------------------------------------- embedding

Status EmbeddingForward(const int32_t* tokens, int n, const float* table, int vocab, int dim, float* out,
                        cudaStream_t stream) {
  return EmbeddingForward(tokens, n, table, DType::kF32, vocab, dim, out, stream);
}

Status EmbeddingForward(const int32_t* tokens, int n, const void* table, DType table_dtype, int vocab, int dim,
                        float* out, cudaStream_t stream) {
  ESTUARY_RETURN_IF_ERROR(CheckRows("cuda embedding", n, dim));
  if (vocab < 1 || CheckedProduct({vocab, dim}) < 0) {
    return InvalidArgument("cuda embedding: vocab {} must be positive", vocab);
  }
  if (n == 0) return Status::Ok();
  if (!tokens || !table || !out) return InvalidArgument("cuda embedding: null buffer");
  const bool vec = dim % 4 == 0 && IsAligned(table, DTypeSize(table_dtype) * 4) && IsAligned(out, 16);
  ESTUARY_CUDA_RETURN_IF_ERROR(
      internal::EmbeddingForward(tokens, n, table, KindOf(table_dtype), vocab, dim, out, vec, stream));
  return Status::Ok();
}

Result<size_t> EmbeddingBackwardScratchBytes(int n) {
  if (n < 0) return InvalidArgument("cuda embedding backward: negative n {}", n);
  size_t bytes = 0;
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::EmbeddingBackwardScratchBytes(n, &bytes));
  return bytes;
}

Status EmbeddingBackward(const int32_t* tokens, int n, const float* dout, int vocab, int dim, float* dtable,
                         Arena& arena, cudaStream_t stream) {
  ESTUARY_RETURN_IF_ERROR(CheckRows("cuda embedding backward", n, dim));
  if (vocab < 1 || CheckedProduct({vocab, dim}) < 0) {
    return InvalidArgument("cuda embedding backward: vocab {} must be positive", vocab);
  }
  if (n == 0) return Status::Ok();
  if (!tokens || !dout || !dtable) return InvalidArgument("cuda embedding backward: null buffer");
  ESTUARY_ASSIGN_OR_RETURN(const size_t bytes, EmbeddingBackwardScratchBytes(n));
  ESTUARY_ASSIGN_OR_RETURN(void* scratch, arena.Allocate(bytes));
  ESTUARY_CUDA_RETURN_IF_ERROR(
      internal::EmbeddingBackward(tokens, n, dout, vocab, dim, dtable, scratch, bytes, stream));
  return Status::Ok();
}

// ------------------------------------------------------------------ RMSNorm

Status RmsNormForward(const float* x, const float* weight, int n, int dim, float eps, void* y, DType y_dtype,
                      float* rstd, cudaStream_t stream) {
  ESTUARY_RETURN_IF_ERROR(CheckRows("cuda rmsnorm", n, dim));
  if (!(eps > 0.0f) || !std::isfinite(eps)) return InvalidArgument("cuda rmsnorm: eps {} must be positive", eps);
  if (n == 0) return Status::Ok();
  if (!x || !weight || !y || !rstd) return InvalidArgument("cuda rmsnorm: null buffer");
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::RmsNormForward(x, weight, n, dim, eps, y, KindOf(y_dtype), rstd, stream));
  return Status::Ok();
}

size_t RmsNormBackwardScratchBytes(int n, int dim) {
  const int64_t chunks = (int64_t(n > 0 ? n : 0) + internal::kRmsRowsPerChunk - 1) / internal::kRmsRowsPerChunk;
  const int64_t floats = chunks * (dim > 0 ? dim : 0);
  return size_t(floats > 0 ? floats : 1) * sizeof(float);
}

Status RmsNormBackward(const float* x, const float* weight, const float* rstd, const float* dy, int n, int dim,
                       float* dx, float* dweight, Arena& arena, cudaStream_t stream, void* dx_copy, DType copy_dtype) {
  ESTUARY_RETURN_IF_ERROR(CheckRows("cuda rmsnorm backward", n, dim));
  if (!dweight || (n > 0 && (!x || !weight || !rstd || !dy || !dx))) {
    return InvalidArgument("cuda rmsnorm backward: null buffer");
  }
  if (dx_copy && copy_dtype == DType::kF32) {
    return InvalidArgument("cuda rmsnorm backward: the dx copy must be bf16 or f16; dx itself is the f32 one");
  }
  const size_t bytes = RmsNormBackwardScratchBytes(n, dim);
  ESTUARY_ASSIGN_OR_RETURN(float* partials, arena.Allocate<float>(int64_t(bytes / sizeof(float))));
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::RmsNormBackward(x, weight, rstd, dy, n, dim, dx, dweight, partials, dx_copy,
                                                         dx_copy ? KindOf(copy_dtype) : Kind::kNone, stream));
  return Status::Ok();
}

// --------------------------------------------------------------------- RoPE

Status RopeTables(int max_seq, int head_dim, double theta, float* cos, float* sin, cudaStream_t stream) {
  if (max_seq < 1 || head_dim < 2 || head_dim % 2 != 0 || !(theta > 1) || !std::isfinite(theta)) {
    return InvalidArgument("cuda rope tables: max_seq {} and an even head_dim {} must be positive, theta {} > 1",
                           max_seq, head_dim, theta);
  }
  if (!cos || !sin) return InvalidArgument("cuda rope tables: null buffer");
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::RopeTables(max_seq, head_dim, theta, cos, sin, stream));
  return Status::Ok();
}

namespace {

Status Rope(const char* what, void* x, DType dtype, int batch, int seq, int heads, int head_dim, int64_t row_stride,
            const float* cos, const float* sin, float sign, cudaStream_t stream) {
  if (batch < 0 || seq < 0 || heads < 1 || head_dim < 2 || head_dim % 2 != 0) {
    return InvalidArgument("{}: batch={} seq={} heads={} head_dim={}: sizes must be positive and head_dim even", what,
                           batch, seq, heads, head_dim);
  }
  if (row_stride < int64_t(heads) * head_dim || CheckedProduct({batch, seq, row_stride}) < 0) {
    return InvalidArgument("{}: row_stride {} is shorter than heads * head_dim = {} or overflows", what, row_stride,
                           int64_t(heads) * head_dim);
  }
  if (batch == 0 || seq == 0) return Status::Ok();
  if (!x || !cos || !sin) return InvalidArgument("{}: null buffer", what);
  ESTUARY_CUDA_RETURN_IF_ERROR(
      internal::Rope(x, KindOf(dtype), batch, seq, heads, head_dim, row_stride, cos, sin, sign, stream));
  return Status::Ok();
}

}  // namespace

Status RopeForward(void* x, DType dtype, int batch, int seq, int heads, int head_dim, int64_t row_stride,
                   const float* cos, const float* sin, cudaStream_t stream) {
  return Rope("cuda rope", x, dtype, batch, seq, heads, head_dim, row_stride, cos, sin, 1.0f, stream);
}

Status RopeBackward(void* dx, DType dtype, int batch, int seq, int heads, int head_dim, int64_t row_stride,
                    const float* cos, const float* sin, cudaStream_t stream) {
  return Rope("cuda rope backward", dx, dtype, batch, seq, heads, head_dim, row_stride, cos, sin, -1.0f, stream);
}

// ------------------------------------------------------------------- SwiGLU

Status SwiGluForward(const void* gate_up, int n, int hidden, void* out, DType dtype, cudaStream_t stream) {
  ESTUARY_RETURN_IF_ERROR(CheckRows("cuda swiglu", n, hidden));
  if (CheckedProduct({n, 2, hidden}) < 0) return InvalidArgument("cuda swiglu: n={} hidden={} overflows", n, hidden);
  if (n == 0) return Status::Ok();
  if (!gate_up || !out) return InvalidArgument("cuda swiglu: null buffer");
  const bool vec = hidden % 4 == 0 && VectorAligned(gate_up, dtype) && VectorAligned(out, dtype);
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::SwiGluForward(gate_up, n, hidden, out, KindOf(dtype), vec, stream));
  return Status::Ok();
}

Status SwiGluBackward(const void* gate_up, const void* dout, int n, int hidden, void* dgate_up, DType dtype,
                      cudaStream_t stream) {
  ESTUARY_RETURN_IF_ERROR(CheckRows("cuda swiglu backward", n, hidden));
  if (CheckedProduct({n, 2, hidden}) < 0) {
    return InvalidArgument("cuda swiglu backward: n={} hidden={} overflows", n, hidden);
  }
  if (n == 0) return Status::Ok();
  if (!gate_up || !dout || !dgate_up) return InvalidArgument("cuda swiglu backward: null buffer");
  const bool vec = hidden % 4 == 0 && VectorAligned(gate_up, dtype) && VectorAligned(dout, dtype) &&
                   VectorAligned(dgate_up, dtype);
  ESTUARY_CUDA_RETURN_IF_ERROR(
      internal::SwiGluBackward(gate_up, dout, n, hidden, dgate_up, KindOf(dtype), vec, stream));
  return Status::Ok();
}

// ---------------------------------------------------------------- attention
//
// Per query head h (kv head g = h / group), batched over the sequences: each
// sequence's Q_h, K_g, V_g are [seq, head_dim] slices of qkv with leading
// dimension `width`, one sequence `seq * width` elements after the previous.
//   S = scale Q K^T -> scores,  P = causal softmax(S),  O = P V
// Backward, as the CPU op:
//   dP = dO V^T,  dV (+)= P^T dO,  dS = scale P (dP - rowsum(P dP)),  dQ = dS K,  dK (+)= dS^T Q
// where (+)= accumulates over the group's query heads in ascending h (beta 1
// after the first), on one stream, so in a fixed order.

Status AttentionForward(const Blas& blas, DType dtype, const void* qkv, int batch, int seq, int heads, int kv_heads,
                        int head_dim, float* scores, void* probs, void* out) {
  ESTUARY_RETURN_IF_ERROR(CheckAttention("cuda attention", batch, seq, heads, kv_heads, head_dim));
  if (!qkv || !scores || !probs || !out) return InvalidArgument("cuda attention: null buffer");
  if (dtype != DType::kF32 && static_cast<void*>(scores) == probs) {
    return InvalidArgument("cuda attention: {} probs cannot share the fp32 scores buffer", DTypeName(dtype));
  }
  const int64_t width = (int64_t(heads) + 2 * kv_heads) * head_dim, out_width = int64_t(heads) * head_dim;
  const int64_t square = int64_t(seq) * seq;
  const int group = heads / kv_heads;
  const float scale = 1.0f / std::sqrt(float(head_dim));
  const GemmTypes to_f32{dtype, DType::kF32, false}, same{dtype, dtype, false};
  for (int h = 0; h < heads; ++h) {
    const int g = h / group;
    ESTUARY_RETURN_IF_ERROR(GemmStridedBatched(
        blas, false, true, seq, seq, head_dim, scale, Advance(qkv, int64_t(h) * head_dim, dtype), width, seq * width,
        Advance(qkv, (int64_t(heads) + g) * head_dim, dtype), width, seq * width, 0.0f, scores + h * square, seq,
        heads * square, batch, to_f32));
  }
  ESTUARY_CUDA_RETURN_IF_ERROR(
      internal::CausalSoftmax(scores, int64_t(batch) * heads * seq, seq, probs, KindOf(dtype), blas.stream()));
  for (int h = 0; h < heads; ++h) {
    const int g = h / group;
    ESTUARY_RETURN_IF_ERROR(GemmStridedBatched(
        blas, false, false, seq, head_dim, seq, 1.0f, Advance(probs, h * square, dtype), seq, heads * square,
        Advance(qkv, (int64_t(heads) + kv_heads + g) * head_dim, dtype), width, seq * width, 0.0f,
        Advance(out, int64_t(h) * head_dim, dtype), out_width, seq * out_width, batch, same));
  }
  return Status::Ok();
}

Status AttentionBackward(const Blas& blas, DType dtype, const void* qkv, const void* probs, const void* dout,
                         int batch, int seq, int heads, int kv_heads, int head_dim, float* dprobs, void* dscores,
                         void* dqkv) {
  ESTUARY_RETURN_IF_ERROR(CheckAttention("cuda attention backward", batch, seq, heads, kv_heads, head_dim));
  if (!qkv || !probs || !dout || !dprobs || !dscores || !dqkv) {
    return InvalidArgument("cuda attention backward: null buffer");
  }
  if (dtype != DType::kF32 && static_cast<void*>(dprobs) == dscores) {
    return InvalidArgument("cuda attention backward: {} dscores cannot share the fp32 dprobs buffer",
                           DTypeName(dtype));
  }
  const int64_t width = (int64_t(heads) + 2 * kv_heads) * head_dim, out_width = int64_t(heads) * head_dim;
  const int64_t square = int64_t(seq) * seq;
  const int group = heads / kv_heads;
  const float scale = 1.0f / std::sqrt(float(head_dim));
  const GemmTypes to_f32{dtype, DType::kF32, false}, same{dtype, dtype, false};
  auto column = [&](int64_t head_slot) { return head_slot * head_dim; };  // first column of a head in qkv
  for (int h = 0; h < heads; ++h) {
    const int g = h / group;
    const float beta = h % group == 0 ? 0.0f : 1.0f;
    const void* d_o = Advance(dout, int64_t(h) * head_dim, dtype);
    // dP = dO V^T (fp32) and dV (+)= P^T dO.
    ESTUARY_RETURN_IF_ERROR(GemmStridedBatched(
        blas, false, true, seq, seq, head_dim, 1.0f, d_o, out_width, seq * out_width,
        Advance(qkv, column(int64_t(heads) + kv_heads + g), dtype), width, seq * width, 0.0f, dprobs + h * square,
        seq, heads * square, batch, to_f32));
    ESTUARY_RETURN_IF_ERROR(GemmStridedBatched(
        blas, true, false, seq, head_dim, seq, 1.0f, Advance(probs, h * square, dtype), seq, heads * square, d_o,
        out_width, seq * out_width, beta, Advance(dqkv, column(int64_t(heads) + kv_heads + g), dtype), width,
        seq * width, batch, same));
  }
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::CausalSoftmaxBackward(probs, KindOf(dtype), dprobs,
                                                               int64_t(batch) * heads * seq, seq, scale, dscores,
                                                               KindOf(dtype), blas.stream()));
  for (int h = 0; h < heads; ++h) {
    const int g = h / group;
    const float beta = h % group == 0 ? 0.0f : 1.0f;
    const void* ds = Advance(static_cast<const void*>(dscores), h * square, dtype);
    // dQ = dS K and dK (+)= dS^T Q.
    ESTUARY_RETURN_IF_ERROR(GemmStridedBatched(
        blas, false, false, seq, head_dim, seq, 1.0f, ds, seq, heads * square,
        Advance(qkv, column(int64_t(heads) + g), dtype), width, seq * width, 0.0f, Advance(dqkv, column(h), dtype),
        width, seq * width, batch, same));
    ESTUARY_RETURN_IF_ERROR(GemmStridedBatched(
        blas, true, false, seq, head_dim, seq, 1.0f, ds, seq, heads * square, Advance(qkv, column(h), dtype), width,
        seq * width, beta, Advance(dqkv, column(int64_t(heads) + g), dtype), width, seq * width, batch, same));
  }
  return Status::Ok();
}

Status ResidualAdd(const float* x, int64_t count, float* y, cudaStream_t stream) {
  if (count < 0) return InvalidArgument("cuda residual add: negative count {}", count);
  if (count == 0) return Status::Ok();
  if (!x || !y) return InvalidArgument("cuda residual add: null buffer");
  const bool vec = IsAligned(x, 16) && IsAligned(y, 16);
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::ResidualAdd(x, count, y, vec, stream));
  return Status::Ok();
}

Status CrossEntropyForwardBackward(const float* logits, const int32_t* targets, int n, int vocab, void* dlogits,
                                   DType dlogits_dtype, float grad_scale, float* loss, Arena& arena,
                                   cudaStream_t stream) {
  if (n < 1 || vocab < 1 || CheckedProduct({n, vocab}) < 0) {
    return InvalidArgument("cuda cross-entropy: needs n >= 1 rows of vocab >= 1 logits, got n={} vocab={}", n, vocab);
  }
  if (!logits || !targets || !dlogits || !loss) return InvalidArgument("cuda cross-entropy: null buffer");
  if (dlogits == static_cast<const void*>(logits) && dlogits_dtype != DType::kF32) {
    return InvalidArgument("cuda cross-entropy: {} dlogits cannot overwrite the f32 logits in place",
                           DTypeName(dlogits_dtype));
  }
  if (!(grad_scale > 0.0f) || !std::isfinite(grad_scale)) {
    return InvalidArgument("cuda cross-entropy: grad_scale {} must be positive and finite", grad_scale);
  }
  ESTUARY_ASSIGN_OR_RETURN(float* row_loss, arena.Allocate<float>(n));
  ESTUARY_ASSIGN_OR_RETURN(int* scored, arena.Allocate<int>(1));
  ESTUARY_CUDA_RETURN_IF_ERROR(internal::CrossEntropy(logits, targets, n, vocab, dlogits, KindOf(dlogits_dtype),
                                                      grad_scale, row_loss, scored, loss, stream));
  return Status::Ok();
}

}  // namespace estuary::models::cuda
