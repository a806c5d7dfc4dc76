// The decoder's ops (models/transformer_ops.h) on the GPU.
//
// Same layouts, formulas and accumulate-or-overwrite rules as the CPU ops,
// which are their reference; the arguments are the CPU op's plus a stream (or
// a Blas, whose stream is used), and where noted a dtype, a scratch Arena, or
// sizes the CPU op trusts its caller for (vocab). Every call checks its sizes
// (64-bit products) and pointers, enqueues its work and returns without
// waiting; device buffers must hold the sizes stated. Token ids live on the
// device and cannot be checked here: an out-of-range id gives NaN rows
// (forward, cross-entropy) or a dropped gradient (embedding backward), never an
// out-of-bounds access.
//
// Mixed precision: ops whose outputs feed a GEMM take a DType for their
// activations (f32, bf16 or f16); they load and store that dtype and compute
// in fp32. Norm statistics, softmax sums, the residual stream, the logits and
// every parameter and its gradient stay fp32. Results repeat bit for bit on
// one device: no atomics, fixed reduction orders.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "base/status.h"
#include "models/cuda/blas.h"
#include "models/cuda/device.h"
#include "models/tensor.h"

namespace estuary::models::cuda {

// out [n, dim] = table[tokens[i], :], table [vocab, dim], all fp32.
Status EmbeddingForward(const int32_t* tokens, int n, const float* table, int vocab, int dim, float* out,
                        cudaStream_t stream);
// The same from a table kept in table_dtype (a bf16/f16 working copy), each
// value widened exactly to fp32.
Status EmbeddingForward(const int32_t* tokens, int n, const void* table, DType table_dtype, int vocab, int dim,
                        float* out, cudaStream_t stream);
// dtable[tokens[i], :] += dout[i, :] (accumulates, as the CPU op), summed per
// token in ascending i. Scratch (EmbeddingBackwardScratchBytes) from `arena`.
Status EmbeddingBackward(const int32_t* tokens, int n, const float* dout, int vocab, int dim, float* dtable,
                         Arena& arena, cudaStream_t stream);
Result<size_t> EmbeddingBackwardScratchBytes(int n);

// y [n, dim] (y_dtype) = weight * x * rstd; rstd [n] fp32; x, weight fp32.
Status RmsNormForward(const float* x, const float* weight, int n, int dim, float eps, void* y, DType y_dtype,
                      float* rstd, cudaStream_t stream);
// dx += dL/dx, dweight = Σ_rows dy * x * rstd (overwritten), all fp32. When
// dx_copy is not null it also receives the updated dx in copy_dtype (bf16/f16):
// the low-precision input of the GEMMs that consume dx next, without a
// separate conversion pass. Scratch (RmsNormBackwardScratchBytes) from `arena`.
Status RmsNormBackward(const float* x, const float* weight, const float* rstd, const float* dy, int n, int dim,
                       float* dx, float* dweight, Arena& arena, cudaStream_t stream, void* dx_copy = nullptr,
                       DType copy_dtype = DType::kBF16);
size_t RmsNormBackwardScratchBytes(int n, int dim);

// cos, sin [max_seq, head_dim / 2], fp32, from angles computed in double.
Status RopeTables(int max_seq, int head_dim, double theta, float* cos, float* sin, cudaStream_t stream);
// In place on `heads` heads at the start of every row of x (dtype), rows
// row_stride elements apart; token (b, t) has position t (< the tables' max_seq,
// the caller's promise). Backward applies the inverse rotation to dx.
Status RopeForward(void* x, DType dtype, int batch, int seq, int heads, int head_dim, int64_t row_stride,
                   const float* cos, const float* sin, cudaStream_t stream);
Status RopeBackward(void* dx, DType dtype, int batch, int seq, int heads, int head_dim, int64_t row_stride,
                    const float* cos, const float* sin, cudaStream_t stream);

// gate_up [n, 2 * hidden] (gate, then up); out [n, hidden] = silu(gate) * up.
// All three buffers of one dtype; backward writes every element of dgate_up.
Status SwiGluForward(const void* gate_up, int n, int hidden, void* out, DType dtype, cudaStream_t stream);
Status SwiGluBackward(const void* gate_up, const void* dout, int n, int hidden, void* dgate_up, DType dtype,
                      cudaStream_t stream);

// Causal grouped-query attention, as models::AttentionForward: qkv [n,
// (heads + 2 kv_heads) * head_dim] (RoPE applied), out [n, heads * head_dim],
// probs [batch, heads, seq, seq] kept for backward (zero above the diagonal),
// all of `dtype`. scores [batch, heads, seq, seq] fp32 is scratch for the
// scaled Q K^T; with dtype f32 it may be probs itself (softmax in place).
// Q K^T and P V go to cuBLAS (strided-batched over the sequences, one call
// per head), fp32 accumulation; the softmax is one fused kernel in fp32.
Status AttentionForward(const Blas& blas, DType dtype, const void* qkv, int batch, int seq, int heads, int kv_heads,
                        int head_dim, float* scores, void* probs, void* out);
// dqkv (same layout as qkv, every element written, `dtype`) from dout [n,
// heads * head_dim]. dprobs [batch, heads, seq, seq] fp32 and dscores (same
// shape, `dtype`; with f32 it may be dprobs) are scratch. Key and value
// gradients of a kv head sum over its query heads in ascending order.
Status AttentionBackward(const Blas& blas, DType dtype, const void* qkv, const void* probs, const void* dout,
                         int batch, int seq, int heads, int kv_heads, int head_dim, float* dprobs, void* dscores,
                         void* dqkv);

// y[i] += x[i], fp32.
Status ResidualAdd(const float* x, int64_t count, float* y, cudaStream_t stream);

// models::CrossEntropyForwardBackward: *loss (one device float) = the mean
// cross-entropy over the rows of `vocab` fp32 logits whose target is not
// kIgnoredTarget (-100); dlogits (dlogits_dtype; may be the logits themselves
// when f32) = (softmax - onehot) * grad_scale / scored, zero on an ignored
// row, grad_scale being the loss scale of fp16 training (1 otherwise; the
// loss itself is never scaled). Every target ignored: loss 0, dlogits 0.
// Scratch of n floats and an int from `arena`.
Status CrossEntropyForwardBackward(const float* logits, const int32_t* targets, int n, int vocab, void* dlogits,
                                   DType dlogits_dtype, float grad_scale, float* loss, Arena& arena,
                                   cudaStream_t stream);

}  // namespace estuary::models::cuda
