#include "models/transformer_ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace estuary::models {

// ---------------------------------------------------------------- embedding

void EmbeddingForward(const int32_t* tokens, int n, const float* table, int dim, float* out) {
  for (int i = 0; i < n; ++i) {
    std::memcpy(out + int64_t(i) * dim, table + int64_t(tokens[i]) * dim, sizeof(float) * dim);
  }
}

void EmbeddingBackward(const int32_t* tokens, int n, const float* dout, int dim, float* dtable) {
  for (int i = 0; i < n; ++i) {
    float* row = dtable + int64_t(tokens[i]) * dim;
    const float* g = dout + int64_t(i) * dim;
    for (int j = 0; j < dim; ++j) row[j] += g[j];
  }
}

// ------------------------------------------------------------------ RMSNorm

void RmsNormForward(const float* x, const float* weight, int n, int dim, float eps, float* y, float* rstd) {
  for (int i = 0; i < n; ++i) {
    const float* xi = x + int64_t(i) * dim;
    float* yi = y + int64_t(i) * dim;
    // The mean of squares in double: the one reduction whose rounding would
    // otherwise grow with dim.
    double sum = 0;
    for (int j = 0; j < dim; ++j) sum += double(xi[j]) * xi[j];
    const float r = float(1.0 / std::sqrt(sum / dim + double(eps)));
    rstd[i] = r;
    for (int j = 0; j < dim; ++j) yi[j] = weight[j] * (xi[j] * r);
  }
}

// With xhat = x * rstd and g = weight * dy:
//   dx = rstd * (g - xhat * mean(g * xhat)),   dweight = Σ_rows dy * xhat.
void RmsNormBackward(const float* x, const float* weight, const float* rstd, const float* dy, int n, int dim,
                     float* dx, float* dweight, bool accumulate) {
  if (!accumulate) std::memset(dweight, 0, sizeof(float) * dim);
  for (int i = 0; i < n; ++i) {
    const float* xi = x + int64_t(i) * dim;
    const float* dyi = dy + int64_t(i) * dim;
    float* dxi = dx + int64_t(i) * dim;
    const float r = rstd[i];
    double dot = 0;
    for (int j = 0; j < dim; ++j) {
      const float xhat = xi[j] * r;
      dot += double(weight[j] * dyi[j]) * xhat;
      dweight[j] += dyi[j] * xhat;
    }
    const float mean = float(dot / dim);
    for (int j = 0; j < dim; ++j) dxi[j] += r * (weight[j] * dyi[j] - xi[j] * r * mean);
  }
}

// --------------------------------------------------------------------- RoPE

void RopeTables(int max_seq, int head_dim, double theta, float* cos, float* sin) {
  const int half = head_dim / 2;
  std::vector<double> inv_freq(half);
  for (int j = 0; j < half; ++j) inv_freq[j] = 1.0 / std::pow(theta, double(2 * j) / head_dim);
  RopeTables(max_seq, half, inv_freq.data(), cos, sin);
}

void RopeTables(int max_seq, int half, const double* inv_freq, float* cos, float* sin) {
  for (int j = 0; j < half; ++j) {
    for (int pos = 0; pos < max_seq; ++pos) {
      cos[int64_t(pos) * half + j] = float(std::cos(pos * inv_freq[j]));
      sin[int64_t(pos) * half + j] = float(std::sin(pos * inv_freq[j]));
    }
  }
}

// Rotates every pair (a, b) = (x[j], x[j + half]) by the angle at (pos, j),
// or by its negative when `sign` is -1 (the inverse, used by backward).
static void Rotate(float* x, int batch, int seq, int heads, int head_dim, int64_t row_stride, const float* cos,
                   const float* sin, float sign) {
  const int half = head_dim / 2;
  for (int b = 0; b < batch; ++b) {
    for (int t = 0; t < seq; ++t) {
      float* row = x + (int64_t(b) * seq + t) * row_stride;
      const float* c = cos + int64_t(t) * half;
      const float* s = sin + int64_t(t) * half;
      for (int h = 0; h < heads; ++h) {
        float* lo = row + int64_t(h) * head_dim;
        float* hi = lo + half;
        for (int j = 0; j < half; ++j) {
          const float a = lo[j], bb = hi[j], sj = sign * s[j];
          lo[j] = a * c[j] - bb * sj;  // x * cos + rotate_half(x) * sin, rotate_half = (-hi, lo)
          hi[j] = bb * c[j] + a * sj;
        }
      }
    }
  }
}

void RopeForward(float* x, int batch, int seq, int heads, int head_dim, int64_t row_stride, const float* cos,
                 const float* sin) {
  Rotate(x, batch, seq, heads, head_dim, row_stride, cos, sin, 1.0f);
}

void RopeBackward(float* dx, int batch, int seq, int heads, int head_dim, int64_t row_stride, const float* cos,
                  const float* sin) {
  Rotate(dx, batch, seq, heads, head_dim, row_stride, cos, sin, -1.0f);
}

// ------------------------------------------------------------------- SwiGLU

void SwiGluForward(const float* gate_up, int n, int hidden, float* out) {
  for (int i = 0; i < n; ++i) {
    const float* g = gate_up + int64_t(i) * 2 * hidden;
    const float* u = g + hidden;
    float* o = out + int64_t(i) * hidden;
    for (int j = 0; j < hidden; ++j) o[j] = g[j] / (1.0f + VectorExp(-g[j])) * u[j];
  }
}

// silu(g) = g * s with s = sigmoid(g); silu'(g) = s * (1 + g * (1 - s)).
void SwiGluBackward(const float* gate_up, const float* dout, int n, int hidden, float* dgate_up) {
  for (int i = 0; i < n; ++i) {
    const float* g = gate_up + int64_t(i) * 2 * hidden;
    const float* u = g + hidden;
    const float* d = dout + int64_t(i) * hidden;
    float* dg = dgate_up + int64_t(i) * 2 * hidden;
    float* du = dg + hidden;
    for (int j = 0; j < hidden; ++j) {
      const float s = 1.0f / (1.0f + VectorExp(-g[j]));
      du[j] = d[j] * g[j] * s;
      dg[j] = d[j] * u[j] * s * (1.0f + g[j] * (1.0f - s));
    }
  }
}

// ---------------------------------------------------------------- attention
//
// For one (sequence b, query head h) with kv head g = h / (heads / kv_heads),
// Q, K, V are [seq, head_dim] slices of qkv with leading dimension
// qkv_width, so BLAS reads them in place:
//   P = softmax_causal(Q K^T / sqrt(head_dim)),   O = P V.
// Backward, with dO:
//   dP = dO V^T,   dV += P^T dO,   dS = P * (dP - rowsum(P * dP)) / sqrt(head_dim),
//   dQ = dS K,     dK += dS^T Q,
// where += runs over the query heads that share a kv head (the first one
// overwrites, so dqkv needs no zeroing).

void AttentionForward(const float* qkv, int batch, int seq, int heads, int kv_heads, int head_dim, float* probs,
                      float* out) {
  const int64_t qkv_width = int64_t(heads + 2 * kv_heads) * head_dim, out_width = int64_t(heads) * head_dim;
  const int group = heads / kv_heads;
  const float scale = 1.0f / std::sqrt(float(head_dim));
  for (int b = 0; b < batch; ++b) {
    const float* rows = qkv + int64_t(b) * seq * qkv_width;
    for (int h = 0; h < heads; ++h) {
      const int g = h / group;
      const float* q = rows + int64_t(h) * head_dim;
      const float* k = rows + int64_t(heads + g) * head_dim;
      const float* v = rows + int64_t(heads + kv_heads + g) * head_dim;
      float* p = probs + (int64_t(b) * heads + h) * seq * seq;
      // The full square is cheaper through BLAS than the triangle by hand;
      // the upper half is then overwritten with zeros.
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, seq, seq, head_dim, scale, q, int(qkv_width), k,
                  int(qkv_width), 0.0f, p, seq);
      for (int i = 0; i < seq; ++i) {
        float* row = p + int64_t(i) * seq;
        float max = row[0];
        for (int j = 1; j <= i; ++j) max = row[j] > max ? row[j] : max;
        for (int j = 0; j <= i; ++j) row[j] = VectorExp(row[j] - max);
        float sum = 0;  // apart from the exps, which then vectorise
        for (int j = 0; j <= i; ++j) sum += row[j];
        const float inv = 1.0f / sum;
        for (int j = 0; j <= i; ++j) row[j] *= inv;
        for (int j = i + 1; j < seq; ++j) row[j] = 0.0f;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, seq, head_dim, seq, 1.0f, p, seq, v, int(qkv_width),
                  0.0f, out + int64_t(b) * seq * out_width + int64_t(h) * head_dim, int(out_width));
    }
  }
}

void AttentionBackward(const float* qkv, const float* probs, const float* dout, int batch, int seq, int heads,
                       int kv_heads, int head_dim, float* dscores, float* dqkv) {
  const int64_t qkv_width = int64_t(heads + 2 * kv_heads) * head_dim, out_width = int64_t(heads) * head_dim;
  const int group = heads / kv_heads;
  const float scale = 1.0f / std::sqrt(float(head_dim));
  const int ld = int(qkv_width);
  for (int b = 0; b < batch; ++b) {
    const float* rows = qkv + int64_t(b) * seq * qkv_width;
    float* drows = dqkv + int64_t(b) * seq * qkv_width;
    const float* dout_b = dout + int64_t(b) * seq * out_width;
    for (int h = 0; h < heads; ++h) {
      const int g = h / group;
      const float beta = h % group == 0 ? 0.0f : 1.0f;
      const int64_t q_col = int64_t(h) * head_dim, k_col = int64_t(heads + g) * head_dim,
                    v_col = int64_t(heads + kv_heads + g) * head_dim;
      const float* p = probs + (int64_t(b) * heads + h) * seq * seq;
      const float* d_o = dout_b + int64_t(h) * head_dim;
      // dP = dO V^T and dV (+)= P^T dO.
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, seq, seq, head_dim, 1.0f, d_o, int(out_width),
                  rows + v_col, ld, 0.0f, dscores, seq);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, seq, head_dim, seq, 1.0f, p, seq, d_o, int(out_width),
                  beta, drows + v_col, ld);
      // Softmax backward, in place: dscores becomes dS (scaled). Masked
      // entries have P = 0, so they come out exactly zero.
      for (int i = 0; i < seq; ++i) {
        const float* pi = p + int64_t(i) * seq;
        float* di = dscores + int64_t(i) * seq;
        float dot = 0;
        for (int j = 0; j <= i; ++j) dot += pi[j] * di[j];
        for (int j = 0; j <= i; ++j) di[j] = scale * pi[j] * (di[j] - dot);
        for (int j = i + 1; j < seq; ++j) di[j] = 0.0f;
      }
      // dQ = dS K and dK (+)= dS^T Q.
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, seq, head_dim, seq, 1.0f, dscores, seq, rows + k_col,
                  ld, 0.0f, drows + q_col, ld);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, seq, head_dim, seq, 1.0f, dscores, seq, rows + q_col, ld,
                  beta, drows + k_col, ld);
    }
  }
}

void ResidualAdd(const float* x, int64_t count, float* y) {
  for (int64_t i = 0; i < count; ++i) y[i] += x[i];
}

// ------------------------------------------------------------ cross-entropy

float CrossEntropyForwardBackward(const float* logits, const int32_t* targets, int n, int vocab, float* dlogits,
                                  float grad_scale) {
  const int scored = int(std::count_if(targets, targets + n, [](int32_t t) { return t != kIgnoredTarget; }));
  double loss = 0;
  for (int i = 0; i < n; ++i) {
    const float* z = logits + int64_t(i) * vocab;
    float* d = dlogits + int64_t(i) * vocab;
    if (targets[i] == kIgnoredTarget) {
      std::fill(d, d + vocab, 0.0f);
      continue;
    }
    // The max and the sum each in eight running lanes: one chain of
    // dependent compares or adds over the row takes longer than its exps.
    float maxes[8];
    std::fill(maxes, maxes + 8, z[0]);
    int at = 0;
    for (; at + 8 <= vocab; at += 8) {
      for (int k = 0; k < 8; ++k) maxes[k] = z[at + k] > maxes[k] ? z[at + k] : maxes[k];
    }
    for (; at < vocab; ++at) maxes[0] = z[at] > maxes[0] ? z[at] : maxes[0];
    const float max = *std::max_element(maxes, maxes + 8);
    const float target_logit = z[targets[i]];  // read before d (maybe z) is overwritten
    for (int c = 0; c < vocab; ++c) d[c] = VectorExp(z[c] - max);
    double sums[8] = {};  // in double, as ever
    for (at = 0; at + 8 <= vocab; at += 8) {
      for (int k = 0; k < 8; ++k) sums[k] += d[at + k];
    }
    for (; at < vocab; ++at) sums[0] += d[at];
    const double sum = ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]));
    loss += std::log(sum) - double(target_logit - max);
    // grad_scale enters where 1 stood, so a scale of 1 gives the unscaled bits.
    const float scale = float(double(grad_scale) / (sum * scored));
    for (int c = 0; c < vocab; ++c) d[c] *= scale;
    d[targets[i]] -= grad_scale / float(scored);
  }
  return scored > 0 ? float(loss / scored) : 0.0f;
}

}  // namespace estuary::models
