// CPU ops of a LLaMA-style decoder, each forward beside its backward.
//
// Activations are row-major fp32 buffers owned by the caller. A batch of
// `batch` sequences of `seq` tokens is n = batch * seq rows; token t of
// sequence b is row b * seq + t. Parameters and their gradients are pointers
// into a model's flat buffers. No op allocates: scratch comes from the caller,
// so a CUDA op can take exactly the same arguments and be checked against
// these. Token ids are not checked here (an op cannot return an error); the
// model validates them before calling.
//
// Gradients are overwritten, with two exceptions that make the model's
// backward pass simple: EmbeddingBackward adds into the table's gradient (a
// tied table also receives the LM head's), and RmsNormBackward adds dx into
// the residual stream's gradient, which carries every later layer's part.
// RmsNormBackward's weight gradient (like Linear's, layers.h) is added to
// instead of overwritten when `accumulate` is set, for micro-batches.
//
// The projections are Linear (layers.h) without bias; every matrix product
// goes to OpenBLAS.
#pragma once

#include <bit>

#include <cstdint>

namespace estuary::models {

// out[i, :] = table[tokens[i], :], table [vocab, dim], out [n, dim].
void EmbeddingForward(const int32_t* tokens, int n, const float* table, int dim, float* out);
// dtable[tokens[i], :] += dout[i, :]. Accumulates: zero dtable first unless it
// already holds the tied LM head's gradient.
void EmbeddingBackward(const int32_t* tokens, int n, const float* dout, int dim, float* dtable);

// Per row of x [n, dim]: y = weight * x * rstd with rstd = 1/sqrt(mean(x^2) + eps).
// rstd [n] is kept for backward.
void RmsNormForward(const float* x, const float* weight, int n, int dim, float eps, float* y, float* rstd);
// dx += dL/dx (added, see above); dweight [dim] = Σ_rows dy * x * rstd
// (overwritten, or added with accumulate).
void RmsNormBackward(const float* x, const float* weight, const float* rstd, const float* dy, int n, int dim,
                     float* dx, float* dweight, bool accumulate = false);

// Rotary position embeddings, Hugging Face LLaMA convention: the two halves of
// each head form the pairs (x[j], x[j + head_dim/2]), rotated by the angle
// pos * theta^(-2j/head_dim). RopeTables fills cos and sin [max_seq, head_dim/2]
// (angles computed in double, then rounded).
void RopeTables(int max_seq, int head_dim, double theta, float* cos, float* sin);
// The same from given inverse frequencies [half] (a rescaled RoPE, see
// LlamaConfig::RopeInverseFrequencies): the angle at (pos, j) is pos * inv_freq[j].
void RopeTables(int max_seq, int half, const double* inv_freq, float* cos, float* sin);
// In place on `heads` heads of head_dim at the start of every row of x, rows
// `row_stride` floats apart (so q and k can be rotated inside a fused qkv
// buffer). Token (b, t) has position t.
void RopeForward(float* x, int batch, int seq, int heads, int head_dim, int64_t row_stride, const float* cos,
                 const float* sin);
// The inverse rotation (the transpose of forward), in place on dx.
void RopeBackward(float* dx, int batch, int seq, int heads, int head_dim, int64_t row_stride, const float* cos,
                  const float* sin);

// exp(x) in fp32 without a libm call, so that a loop of it vectorises (the
// decoder's softmaxes and SiLU take about 7 % of a CPU LoRA step through
// expf otherwise): Cephes' expf, x = n ln 2 + r with |r| <= ln 2 / 2 and a
// degree-6 polynomial for e^r, within 2 ulp of expf. Inputs below -87.34
// (e^x subnormal) give 0, above 88 saturate at e^88 (no step reaches either: softmax inputs
// are <= 0, and a SiLU gate of -88 is silu's 0 either way); NaN gives NaN.
inline float VectorExp(float x) {
  constexpr float kLow = -87.33654f;  // ln of the smallest normal float
  // NaN takes the low bound here (a float-to-int conversion of NaN is
  // undefined) and comes back as itself below.
  const float clamped = !(x >= kLow) ? kLow : x > 88.0f ? 88.0f : x;
  // Round to nearest by the 1.5 * 2^23 trick: exact for |t| < 2^22.
  const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float scale = std::bit_cast<float>((int32_t(n) + 127) << 23);
  return x < kLow ? 0.0f : x == x ? p * scale : x;
}

// gate_up [n, 2 * hidden] holds gate in its first `hidden` columns and up in
// the rest (the layout of a fused gate/up projection). out [n, hidden] =
// silu(gate) * up.
void SwiGluForward(const float* gate_up, int n, int hidden, float* out);
// dgate_up [n, 2 * hidden] (same layout) from dout [n, hidden].
void SwiGluBackward(const float* gate_up, const float* dout, int n, int hidden, float* dgate_up);

// Causal multi-head attention with grouped-query attention: query head h
// reads key/value head h / (heads / kv_heads), as Hugging Face's repeat_kv.
// qkv [n, (heads + 2 * kv_heads) * head_dim] holds, per row, the query heads,
// then the key heads, then the value heads (RoPE already applied to q and k).
// Scores are scaled by 1/sqrt(head_dim). probs [batch, heads, seq, seq]
// receives the softmax probabilities (zero above the diagonal) for backward;
// out [n, heads * head_dim] is the concatenation of the heads.
void AttentionForward(const float* qkv, int batch, int seq, int heads, int kv_heads, int head_dim, float* probs,
                      float* out);
// dqkv (same layout as qkv, every element written) from dout [n, heads * head_dim].
// dscores is scratch of seq * seq floats.
void AttentionBackward(const float* qkv, const float* probs, const float* dout, int batch, int seq, int heads,
                       int kv_heads, int head_dim, float* dscores, float* dqkv);

// y[i] += x[i]: the residual connection.
void ResidualAdd(const float* x, int64_t count, float* y);

// A target that scores nothing: PyTorch's and Hugging Face's ignore_index.
inline constexpr int32_t kIgnoredTarget = -100;

// Mean softmax cross-entropy over the n rows of `vocab` logits whose target
// is not kIgnoredTarget (F.cross_entropy with ignore_index=-100), with
// dlogits = grad_scale * (softmax - onehot(target)) / scored written in the
// same pass (the loss returned is not scaled); an ignored row's dlogits are
// zero. With every target ignored the loss is 0 and every dlogit 0 (torch
// gives NaN there; a batch of prompts alone must not poison the weights).
// Unlike SoftmaxCrossEntropy (layers.h), made for a vocabulary-sized row: one
// float exp (VectorExp) per logit instead of two double ones, and dlogits may alias
// logits, so the [n, vocab] gradient needs no buffer of its own.
float CrossEntropyForwardBackward(const float* logits, const int32_t* targets, int n, int vocab, float* dlogits,
                                  float grad_scale = 1.0f);

}  // namespace estuary::models
