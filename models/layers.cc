#include "models/layers.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "models/conv_dnnl.h"
#include "models/dot_forward.h"
#include "models/small_gemm.h"

namespace estuary::models {

namespace {

// Per-thread scratch of the small-batch paths and the convolutions (transposed
// operands, scaled gradients, bias sums): grown on first use and never shrunk,
// so steady steps allocate nothing.
float* Scratch(int slot, size_t floats) {
  thread_local std::vector<float> buffers[3];
  std::vector<float>& buffer = buffers[slot];
  if (buffer.size() < floats) buffer.resize(floats);
  return buffer.data();
}

// Sgemm, or OpenBLAS alone for a layer that is not small_batch.
void Gemm(bool small_batch, bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc) {
  if (small_batch) return Sgemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  SgemmOn(GemmEngine::kOpenBlas, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace

void Linear::Forward(const float* x, int n, float* y, Activation activation) const {
  // Y = X·Wᵀ puts the transpose on the right, where libxsmm takes none. Where
  // it pays (models/small_gemm.h) the layer forms Yᵀ = W·Xᵀ instead ([out, n]:
  // the vector runs along the batch) and turns it back in the pass that adds
  // the bias and applies the activation.
  if (small_batch && XsmmForwardPays(n, in, out)) {
    float* xt = Scratch(0, size_t(in) * n);
    float* yt = Scratch(1, size_t(out) * n);
    for (int i = 0; i < n; ++i) {
      const float* row = x + int64_t(i) * in;
      for (int j = 0; j < in; ++j) xt[int64_t(j) * n + i] = row[j];
    }
    Gemm(true, false, false, out, n, in, 1.0f, w, in, xt, n, 0.0f, yt, n);
    for (int i = 0; i < n; ++i) {
      float* row = y + int64_t(i) * out;
      for (int o = 0; o < out; ++o) {
        const float v = yt[int64_t(o) * n + i] + (b ? b[o] : 0.0f);
        row[o] = activation == Activation::kRelu && !(v > 0.0f) ? 0.0f : v;
      }
    }
    return;
  }
  // Where it does not (AVX2 at training's batch of 10), dot products of x's
  // rows with W's, which pack nothing (models/dot_forward.h).
  if (small_batch && n <= kSmallGemmDim && HaveDotForward()) {
    return DotForward(x, n, in, w, out, b, activation == Activation::kRelu, y);
  }
  if (b) {
    for (int i = 0; i < n; ++i) std::memcpy(y + int64_t(i) * out, b, sizeof(float) * out);
  }
  Gemm(small_batch, false, true, n, out, in, 1.0f, x, in, w, in, b ? 1.0f : 0.0f, y, out);
  if (activation == Activation::kRelu) ReluForward(y, int64_t(n) * out);
}

void Linear::Backward(const float* x, const float* dy, int n, float* dx, bool accumulate) const {
  if (dw) Gemm(small_batch, true, false, out, in, n, 1.0f, dy, out, x, in, accumulate ? 1.0f : 0.0f, dw, in);
  if (db) {
    for (int o = 0; !accumulate && o < out; ++o) db[o] = 0;
    for (int i = 0; i < n; ++i) {
      const float* row = dy + int64_t(i) * out;
      for (int o = 0; o < out; ++o) db[o] += row[o];
    }
  }
  if (dx) Gemm(small_batch, false, false, n, in, out, 1.0f, dy, out, w, in, 0.0f, dx, in);
}

void Linear::BackwardSgd(const float* x, const float* dy, int n, float* dx, float lr, float wd) const {
  if (dx) Gemm(small_batch, false, false, n, in, out, 1.0f, dy, out, w, in, 0.0f, dx, in);
  const float keep = 1.0f - lr * wd;
  // libxsmm's kernels take neither alpha nor a beta other than 0 or 1: at a
  // small batch the step scales dy by -lr, in the pass that sums it for the
  // bias, scales W by keep where there is weight decay, and adds
  // (-lr·dy)ᵀ·x into W with beta 1. OpenBLAS scales inside the product.
  const bool small = small_batch && ChooseGemmEngine(true, false, out, in, n, 1.0f, 1.0f) == GemmEngine::kXsmm;
  float* scaled = small ? Scratch(0, size_t(n) * out) : nullptr;
  for (int o = 0; o < out; ++o) {
    float sum = 0;
    for (int i = 0; i < n; ++i) {
      const float g = dy[int64_t(i) * out + o];
      sum += g;
      if (small) scaled[int64_t(i) * out + o] = -lr * g;
    }
    if (b) b[o] = keep * b[o] - lr * sum;
  }
  if (small) {
    if (keep != 1.0f) {
      for (int64_t i = 0; i < int64_t(out) * in; ++i) w[i] *= keep;
    }
    Gemm(true, true, false, out, in, n, 1.0f, scaled, out, x, in, 1.0f, w, in);
  } else {
    Gemm(small_batch, true, false, out, in, n, -lr, dy, out, x, in, keep, w, in);
  }
}

void LinearGroup::Forward(const float* x, int n, float* y) const {
  if (count == 1) return parts[0].Forward(x, n, y);
  int column = 0;
  for (int k = 0; k < count; ++k) {
    const Linear& p = parts[k];
    float* slice = y + column;
    if (p.b) {
      for (int i = 0; i < n; ++i) std::memcpy(slice + int64_t(i) * width, p.b, sizeof(float) * p.out);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, p.out, p.in, 1.0f, x, p.in, p.w, p.in, p.b ? 1.0f : 0.0f,
                slice, width);
    column += p.out;
  }
}

void LinearGroup::Backward(const float* x, const float* dy, int n, float* dx, bool accumulate) const {
  if (count == 1) return parts[0].Backward(x, dy, n, dx, accumulate);
  int column = 0;
  for (int k = 0; k < count; ++k) {
    const Linear& p = parts[k];
    const float* slice = dy + column;
    if (p.dw) {
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, p.out, p.in, n, 1.0f, slice, width, x, p.in,
                  accumulate ? 1.0f : 0.0f, p.dw, p.in);
    }
    if (p.db) {
      for (int o = 0; !accumulate && o < p.out; ++o) p.db[o] = 0;
      for (int i = 0; i < n; ++i) {
        const float* row = slice + int64_t(i) * width;
        for (int o = 0; o < p.out; ++o) p.db[o] += row[o];
      }
    }
    if (dx) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, p.in, p.out, 1.0f, slice, width, p.w, p.in,
                  k == 0 ? 0.0f : 1.0f, dx, p.in);
    }
    column += p.out;
  }
}

LinearGroup LinearGroup::Frozen() const {
  LinearGroup frozen = *this;
  for (Linear& p : frozen.parts) p.dw = p.db = nullptr;
  return frozen;
}

void ReluForward(float* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

void ReluBackward(const float* y, float* dy, int64_t count) {
  for (int64_t i = 0; i < count; ++i) dy[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

// Unfolds one image [c, h, w] into cols [c*k*k, h*w] (zero padding).
static void Im2Col(const float* x, int c, int h, int w, int k, int pad, float* cols) {
  for (int ch = 0; ch < c; ++ch) {
    for (int ky = 0; ky < k; ++ky) {
      for (int kx = 0; kx < k; ++kx) {
        float* out = cols + ((int64_t(ch) * k + ky) * k + kx) * h * w;
        for (int y = 0; y < h; ++y) {
          const int sy = y + ky - pad;
          float* row = out + int64_t(y) * w;
          if (sy < 0 || sy >= h) {
            std::memset(row, 0, sizeof(float) * w);
            continue;
          }
          const float* src = x + (int64_t(ch) * h + sy) * w;
          const int x0 = std::max(0, pad - kx), x1 = std::min(w, w + pad - kx);
          for (int xx = 0; xx < x0; ++xx) row[xx] = 0;
          std::memcpy(row + x0, src + x0 + kx - pad, sizeof(float) * (x1 - x0));
          for (int xx = x1; xx < w; ++xx) row[xx] = 0;
        }
      }
    }
  }
}

// The adjoint of Im2Col: adds cols back into dx [c, h, w] (dx zeroed first).
static void Col2Im(const float* cols, int c, int h, int w, int k, int pad, float* dx) {
  std::memset(dx, 0, sizeof(float) * c * h * w);
  for (int ch = 0; ch < c; ++ch) {
    for (int ky = 0; ky < k; ++ky) {
      for (int kx = 0; kx < k; ++kx) {
        const float* in = cols + ((int64_t(ch) * k + ky) * k + kx) * h * w;
        for (int y = 0; y < h; ++y) {
          const int sy = y + ky - pad;
          if (sy < 0 || sy >= h) continue;
          float* dst = dx + (int64_t(ch) * h + sy) * w;
          const float* row = in + int64_t(y) * w;
          const int x0 = std::max(0, pad - kx), x1 = std::min(w, w + pad - kx);
          for (int xx = x0; xx < x1; ++xx) dst[xx + kx - pad] += row[xx];
        }
      }
    }
  }
}

void Conv2d::Forward(const float* x, int n, float* cols, float* y, Activation activation) const {
  if (ConvOnDnnl(*this)) return DnnlConvForward(*this, x, n, cols, y, activation == Activation::kRelu);
  const int hw = height * width;
  const int kdim = in_channels * kernel * kernel;
  for (int i = 0; i < n; ++i) {
    float* col = cols + i * col_size();
    Im2Col(x + int64_t(i) * in_channels * hw, in_channels, height, width, kernel, pad, col);
    float* out = y + int64_t(i) * out_channels * hw;
    for (int o = 0; o < out_channels; ++o) std::fill(out + int64_t(o) * hw, out + int64_t(o + 1) * hw, b[o]);
    Sgemm(false, false, out_channels, hw, kdim, 1.0f, w, kdim, col, hw, 1.0f, out, hw);
    // While the image's output is still in cache.
    if (activation == Activation::kRelu) ReluForward(out, int64_t(out_channels) * hw);
  }
}

namespace {

// What the two backward passes of Conv2d share: the bias sums and the weight
// product. dW = dY·colsᵀ puts the transpose on the right, where libxsmm takes
// none, so each image adds colsᵢ·dYᵢᵀ into dWᵀ [kdim, out] (scratch): dYᵢ is
// transposed in the pass that sums it for the bias (out × h·w floats, a
// fraction of cols' kdim × h·w). The caller turns dWᵀ into W or dW once per call.
const float* ConvWeightProductTransposed(const Conv2d& c, const float* cols, const float* dy, int n, float* bias_sum) {
  const int hw = c.height * c.width;
  const int kdim = c.in_channels * c.kernel * c.kernel;
  float* dyt = Scratch(0, size_t(hw) * c.out_channels);
  float* dwt = Scratch(1, size_t(kdim) * c.out_channels);
  for (int o = 0; o < c.out_channels; ++o) bias_sum[o] = 0;
  if (n == 0) std::fill(dwt, dwt + size_t(kdim) * c.out_channels, 0.0f);
  for (int i = 0; i < n; ++i) {
    const float* g = dy + int64_t(i) * c.out_channels * hw;
    for (int o = 0; o < c.out_channels; ++o) {
      const float* row = g + int64_t(o) * hw;
      float sum = 0;
      for (int p = 0; p < hw; ++p) {
        sum += row[p];
        dyt[int64_t(p) * c.out_channels + o] = row[p];
      }
      bias_sum[o] += sum;
    }
    Sgemm(false, false, kdim, c.out_channels, hw, 1.0f, cols + i * c.col_size(), hw, dyt, c.out_channels,
          i == 0 ? 0.0f : 1.0f, dwt, c.out_channels);
  }
  return dwt;
}

}  // namespace

// dx = col2im(Wᵀ · dY) for each image, with the current W.
void Conv2d::InputGradient(const float* dy, int n, float* dcol, float* dx) const {
  const int hw = height * width;
  const int kdim = in_channels * kernel * kernel;
  for (int i = 0; i < n; ++i) {
    Sgemm(true, false, kdim, hw, out_channels, 1.0f, w, kdim, dy + int64_t(i) * out_channels * hw, hw, 0.0f, dcol,
          hw);
    Col2Im(dcol, in_channels, height, width, kernel, pad, dx + int64_t(i) * in_channels * hw);
  }
}

void Conv2d::Backward(const float* cols, const float* dy, int n, float* dcol, float* dx, bool accumulate) const {
  const int kdim = in_channels * kernel * kernel;
  if (ConvOnDnnl(*this)) {
    float* grads = Scratch(1, size_t(kdim + 1) * out_channels);  // dW [out, kdim], then db
    const float* bias_grads = grads + int64_t(kdim) * out_channels;
    DnnlConvBackward(*this, cols, dy, n, dx, grads, grads + int64_t(kdim) * out_channels);
    for (int64_t i = 0; i < int64_t(kdim) * out_channels; ++i) dw[i] = (accumulate ? dw[i] : 0.0f) + grads[i];
    for (int o = 0; o < out_channels; ++o) db[o] = (accumulate ? db[o] : 0.0f) + bias_grads[o];
    return;
  }
  float* bias_sum = Scratch(2, size_t(out_channels));
  const float* dwt = ConvWeightProductTransposed(*this, cols, dy, n, bias_sum);
  for (int o = 0; o < out_channels; ++o) {
    db[o] = (accumulate ? db[o] : 0.0f) + bias_sum[o];
    float* row = dw + int64_t(o) * kdim;
    for (int j = 0; j < kdim; ++j) row[j] = (accumulate ? row[j] : 0.0f) + dwt[int64_t(j) * out_channels + o];
  }
  if (dx) InputGradient(dy, n, dcol, dx);
}

void Conv2d::BackwardSgd(const float* cols, const float* dy, int n, float* dcol, float* dx, float lr,
                         float wd) const {
  const int kdim = in_channels * kernel * kernel;
  const float keep = 1.0f - lr * wd;
  if (ConvOnDnnl(*this)) {
    // dx first, with the old W, inside the call; then W and b from the gradients.
    float* grads = Scratch(1, size_t(kdim + 1) * out_channels);
    DnnlConvBackward(*this, cols, dy, n, dx, grads, grads + int64_t(kdim) * out_channels);
    for (int64_t i = 0; i < int64_t(kdim) * out_channels; ++i) w[i] = keep * w[i] - lr * grads[i];
    for (int o = 0; o < out_channels; ++o) b[o] = keep * b[o] - lr * grads[int64_t(kdim) * out_channels + o];
    return;
  }
  if (dx) InputGradient(dy, n, dcol, dx);  // every dx first: they need the old W
  float* bias_sum = Scratch(2, size_t(out_channels));
  const float* dwt = ConvWeightProductTransposed(*this, cols, dy, n, bias_sum);
  for (int o = 0; o < out_channels; ++o) {
    b[o] = keep * b[o] - lr * bias_sum[o];
    float* row = w + int64_t(o) * kdim;
    for (int j = 0; j < kdim; ++j) row[j] = keep * row[j] - lr * dwt[int64_t(j) * out_channels + o];
  }
}

void MaxPool2::Forward(const float* x, int n, float* y, int32_t* argmax) const {
  const int oh = height / 2, ow = width / 2;
  for (int64_t plane = 0; plane < int64_t(n) * channels; ++plane) {
    const float* in = x + plane * height * width;
    const int32_t base = int32_t(plane * height * width);
    float* out = y + plane * oh * ow;
    int32_t* arg = argmax + plane * oh * ow;
    for (int r = 0; r < oh; ++r) {
      for (int c = 0; c < ow; ++c) {
        int best = (2 * r) * width + 2 * c;
        // Ties go to the first element in row-major order, as in PyTorch.
        for (int candidate : {best + 1, best + width, best + width + 1}) {
          if (in[candidate] > in[best]) best = candidate;
        }
        out[r * ow + c] = in[best];
        arg[r * ow + c] = base + best;
      }
    }
  }
}

void MaxPool2::Backward(const float* dy, const int32_t* argmax, int n, float* dx) const {
  const int64_t outputs = int64_t(n) * channels * (height / 2) * (width / 2);
  std::memset(dx, 0, sizeof(float) * n * channels * height * width);
  for (int64_t i = 0; i < outputs; ++i) dx[argmax[i]] += dy[i];
}

float SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int n, int classes, float* dlogits,
                          int64_t* correct, float grad_scale) {
  double loss = 0;
  for (int i = 0; i < n; ++i) {
    const float* z = logits + int64_t(i) * classes;
    int arg = 0;
    for (int c = 1; c < classes; ++c) {
      if (z[c] > z[arg]) arg = c;
    }
    if (correct && arg == labels[i]) ++*correct;
    const float max = z[arg];
    // A classifier's few exponentials are kept for the gradient rather than
    // taken twice (at batch 10 they are a few percent of an MLP step).
    constexpr int kKept = 64;
    double kept[kKept];
    const bool keep = classes <= kKept;
    double sum = 0;
    for (int c = 0; c < classes; ++c) {
      const double e = std::exp(double(z[c] - max));
      if (keep) kept[c] = e;
      sum += e;
    }
    const double log_sum = std::log(sum);
    loss += log_sum - double(z[labels[i]] - max);
    if (dlogits) {
      float* d = dlogits + int64_t(i) * classes;
      for (int c = 0; c < classes; ++c) {
        const double p = keep ? kept[c] / sum : std::exp(double(z[c] - max) - log_sum);
        // Scaled after the division, so grad_scale 1 gives the same bits as no scale.
        d[c] = float((p - (c == labels[i] ? 1.0 : 0.0)) / n * double(grad_scale));
      }
    }
  }
  return float(loss / n);
}

}  // namespace estuary::models
