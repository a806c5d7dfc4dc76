// Launchers of the decoder's kernels (internal; see models/cuda/transformer.h
// for the contracts and kernels.h for the rules every launcher follows: no
// base/status.h here, 64-bit grid arithmetic, cudaGetLastError() after each
// launch, arguments already checked by the caller).
//
// Activation dtypes are a Kind: kF32, kBF16 or kF16. Every kernel computes in
// fp32 whatever it stores, and every reduction (norm statistics, softmax
// sums, the embedding's and the norm weight's gradient) runs in a fixed order,
// so a step gives the same bits run after run on one device.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "models/cuda/kernels.h"

namespace estuary::models::cuda::internal {

// out[i, :] = table[tokens[i], :] widened to fp32 (NaN for a token outside
// [0, vocab)); the table in table_kind.
cudaError_t EmbeddingForward(const int32_t* tokens, int n, const void* table, Kind table_kind, int vocab, int dim,
                             float* out, bool vec, cudaStream_t s);

// Bytes of scratch EmbeddingBackward needs for n tokens (CUB's radix sort
// plus three int32 arrays), each part rounded up to 256 bytes.
cudaError_t EmbeddingBackwardScratchBytes(int n, size_t* bytes);
// dtable[tokens[i], :] += dout[i, :], summed per token in ascending i (the CPU
// order), without atomics: the positions are stably sorted by token, and one
// block per distinct token walks its run.
cudaError_t EmbeddingBackward(const int32_t* tokens, int n, const float* dout, int vocab, int dim, float* dtable,
                              void* scratch, size_t scratch_bytes, cudaStream_t s);

// One warp per row; y in y_kind.
cudaError_t RmsNormForward(const float* x, const float* weight, int n, int dim, float eps, void* y, Kind y_kind,
                           float* rstd, cudaStream_t s);
// Rows of dweight partial sums the backward pass uses: ceil(n / kRmsRowsPerChunk).
constexpr int kRmsRowsPerChunk = 128;
// dx += ...; dx_copy (if copy_kind != kNone) = the new dx in copy_kind; dweight
// through partials [chunks, dim] (scratch) summed in chunk order.
cudaError_t RmsNormBackward(const float* x, const float* weight, const float* rstd, const float* dy, int n, int dim,
                            float* dx, float* dweight, float* partials, void* dx_copy, Kind copy_kind,
                            cudaStream_t s);

cudaError_t RopeTables(int max_seq, int head_dim, double theta, float* cos, float* sin, cudaStream_t s);
// sign +1: forward rotation, -1: its inverse (backward).
cudaError_t Rope(void* x, Kind kind, int batch, int seq, int heads, int head_dim, int64_t row_stride,
                 const float* cos, const float* sin, float sign, cudaStream_t s);

cudaError_t SwiGluForward(const void* gate_up, int n, int hidden, void* out, Kind kind, bool vec, cudaStream_t s);
cudaError_t SwiGluBackward(const void* gate_up, const void* dout, int n, int hidden, void* dgate_up, Kind kind,
                           bool vec, cudaStream_t s);

cudaError_t ResidualAdd(const float* x, int64_t count, float* y, bool vec, cudaStream_t s);

// rows = batch * heads * seq rows of seq fp32 scores (already scaled); row r
// is query position r % seq. probs (probs_kind; may alias scores when fp32)
// gets the causal softmax, zero above the diagonal.
cudaError_t CausalSoftmax(const float* scores, int64_t rows, int seq, void* probs, Kind probs_kind, cudaStream_t s);
// dscores = scale * P * (dP - rowsum(P * dP)) on and below the diagonal, zero
// above; dscores (ds_kind) may alias dprobs when fp32.
cudaError_t CausalSoftmaxBackward(const void* probs, Kind probs_kind, const float* dprobs, int64_t rows, int seq,
                                  float scale, void* dscores, Kind ds_kind, cudaStream_t s);

// First *scored = the number of targets that are not -100 (ignored). Per row
// (one block): row_loss[i] = logsumexp(z) - z[target]; dlogits (dlogits_kind;
// may alias logits when fp32) = (softmax - onehot) * grad_scale / scored; an
// ignored row's loss and dlogits are 0. Then one block: *loss = the sum of
// row_loss over scored (0 when nothing scores), summed in double in row
// order. Any other target outside [0, vocab) makes its row's loss and
// gradient NaN.
cudaError_t CrossEntropy(const float* logits, const int32_t* targets, int n, int vocab, void* dlogits,
                         Kind dlogits_kind, float grad_scale, float* row_loss, int* scored, float* loss,
                         cudaStream_t s);

}  // namespace estuary::models::cuda::internal
