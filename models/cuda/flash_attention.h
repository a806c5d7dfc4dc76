// Causal grouped-query attention without the seq x seq matrix, for bf16 and
// fp16 (FlashAttention-2's schedule on the tensor cores through mma.sync).
//
// The materialised path (transformer.h's AttentionForward/Backward) writes
// fp32 scores and low-precision probabilities of [batch, heads, seq, seq] and
// reads them back several times: at seq 1024 that is most of a step's memory
// traffic. Here a block of 4 warps keeps a 64-row query tile in registers
// (16 rows a warp) and streams the key and value tiles up to the diagonal
// past it through double-buffered shared memory, with an online softmax in
// registers; only the output and one log-sum-exp per row reach memory.
// Backward recomputes the probabilities tile by tile from that log-sum-exp:
// one kernel forms dK and dV per key tile (a kv head's query heads summed in
// ascending order, no atomics), another dQ per query tile, so results repeat
// bit for bit. The kernels are in flash_attention_{forward,backward}.cu.
//
// Layouts as transformer.h: qkv [n, (heads + 2 kv_heads) * head_dim] with
// RoPE applied, out and dout [n, heads * head_dim], n = batch * seq rows,
// sequence-major; lse and delta [batch, heads, seq] fp32. qkv, out, dout and
// dqkv must be 16-byte aligned (cudaMalloc'd buffers and the engine's are).
// Products take bf16/fp16 inputs (the probabilities and their gradients
// rounded to the same type) with fp32 accumulation; softmax statistics and
// accumulators are fp32.
#pragma once

#include <cuda_runtime_api.h>

#include "base/status.h"
#include "models/tensor.h"

namespace estuary::models::cuda {

// Whether the fused kernels take this shape: dtype bf16 or f16, head_dim 64.
bool FlashAttentionSupports(DType dtype, int head_dim);

// out = softmax(Q Kᵀ / sqrt(head_dim), causal) V per head; lse = the log of
// each row's softmax denominator (scaled scores), kept for backward.
Status FlashAttentionForward(DType dtype, const void* qkv, int batch, int seq, int heads, int kv_heads,
                             int head_dim, void* out, float* lse, cudaStream_t stream);

// dqkv (every element written, `dtype`) from out, dout and lse of the
// forward pass; delta [batch, heads, seq] fp32 is scratch.
Status FlashAttentionBackward(DType dtype, const void* qkv, const void* out, const void* dout, const float* lse,
                              int batch, int seq, int heads, int kv_heads, int head_dim, float* delta, void* dqkv,
                              cudaStream_t stream);

}  // namespace estuary::models::cuda
