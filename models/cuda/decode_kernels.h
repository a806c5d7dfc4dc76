// Launchers of the cached decoder's kernels (internal; see llama_decoder.h
// for the contract and kernels.h for the rules every launcher follows).
//
// One sequence: qkv [rows, (heads + 2 kv_heads) * head_dim] holds the chunk's
// queries, keys and values after RoPE (kind), the chunk at positions past ...
// past + rows - 1; keys and values are one layer's cache, [kv_heads,
// capacity, head_dim] each, in the same kind.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "models/cuda/kernels.h"

namespace estuary::models::cuda::internal {

// The widest head the attention kernel holds in registers: 32 lanes x 8.
constexpr int kDecodeMaxHeadDim = 256;

// keys[g, past + t, :] = qkv[t, k head g], values likewise from the v heads.
cudaError_t AppendKv(const void* qkv, Kind kind, int rows, int heads, int kv_heads, int head_dim, int capacity,
                     int past, void* keys, void* values, cudaStream_t s);

// out [rows, heads * head_dim] (kind): for query row t and head h, softmax
// over cache positions j <= past + t of scale * q·k_j, times v_j, reading kv
// head h / (heads / kv_heads). fp32 throughout, one warp per (t, h), keys in
// ascending order with an online (running max) softmax.
cudaError_t DecodeAttention(const void* qkv, const void* keys, const void* values, Kind kind, int rows, int heads,
                            int kv_heads, int head_dim, int capacity, int past, float scale, void* out,
                            cudaStream_t s);

}  // namespace estuary::models::cuda::internal
