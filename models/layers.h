// CPU layers with explicit forward and backward, side by side.
//
// Every layer works on a batch of n examples in row-major buffers that the
// model owns (its activation arena); parameters and their gradients are
// pointers into the model's flat buffers. Backward overwrites the parameter
// gradients, or adds into them with `accumulate` (micro-batches: the GEMM's
// beta is 1 and the bias sums start from what is there, so no second buffer).
// Matrix products go through models/small_gemm.h (libxsmm at a small batch,
// OpenBLAS otherwise); layouts follow PyTorch.
#pragma once

#include <array>
#include <cstdint>

namespace estuary::models {

// What a layer applies to its output in the same pass (Linear::Forward).
enum class Activation { kNone, kRelu };

// y[n, out] = x[n, in] · W[out, in]^T + b. Without bias when b (and db) are
// null, as the projections of a transformer.
struct Linear {
  int in = 0, out = 0;
  float *w = nullptr, *b = nullptr, *dw = nullptr, *db = nullptr;
  // Batch-sized products may run on libxsmm (models/small_gemm.h), and the
  // forward on an AVX2 dot-product kernel (models/dot_forward.h): the
  // classifiers' layers, whose rows are a client's batch. Otherwise (the
  // decoders, whose rows are batch × sequence and vary with a rank's share)
  // every product is OpenBLAS's, so a split of the rows changes only the
  // summation order, never the engine.
  bool small_batch = false;

  // With kRelu, y = max(y, 0) as well (as ReluForward after it).
  void Forward(const float* x, int n, float* y, Activation activation = Activation::kNone) const;
  // dW = dy^T · x, db = Σ_n dy (or dW += ..., db += ... with accumulate), and
  // dx = dy · W when dx is not null; W is read only for dx. A frozen layer
  // (dw and db null, as LoRA's base weights) forms only dx: no dW GEMM.
  void Backward(const float* x, const float* dy, int n, float* dx, bool accumulate = false) const;
  // Plain SGD fused into backward: dx = dy · W with the old W, then
  // W = (1 - lr·wd)·W - lr·dy^T·x in the same GEMM, so dW never exists.
  void BackwardSgd(const float* x, const float* dy, int n, float* dx, float lr, float wd) const;
};

// Projections of one input whose outputs sit side by side in each row of one
// buffer (q, k, v of attention; gate and up of SwiGLU). When their weights
// are adjacent and there is no bias they are a single Linear and one GEMM
// (count 1); otherwise (Hugging Face's state_dict puts each bias right after
// its weight) each part is a GEMM writing its column slice of the rows.
struct LinearGroup {
  std::array<Linear, 3> parts;  // the first `count`, in output-column order
  int count = 0;
  int width = 0;  // the parts' outputs together

  void Forward(const float* x, int n, float* y) const;
  // As Linear::Backward, with dy [n, width]; dx is formed once from every part.
  void Backward(const float* x, const float* dy, int n, float* dx, bool accumulate = false) const;
  // A copy without weight or bias gradients (a frozen base: dx only).
  LinearGroup Frozen() const;
};

// In place: x = max(x, 0).
void ReluForward(float* x, int64_t count);
// dx = dy where the forward output was positive; in place on dy.
void ReluBackward(const float* y, float* dy, int64_t count);

// Conv2d, stride 1, zero padding `pad`, square kernel k, on [n, c, h, w].
// Its products are per image (W [out, c·k·k] against one image's columns), so
// their shapes, and with them the engine Sgemm picks (libxsmm for the MNIST
// CNN's), are a function of the layer alone, never of the batch or of a
// rank's share of it.
//
// A layer whose channel counts are multiples of 8 (the CNN's conv2) runs on
// oneDNN's direct convolution instead where the build has it
// (models/conv_dnnl.h: bench/conv_engines measures it faster there, and
// slower on conv1's single input channel); cols then keeps the input in
// oneDNN's layout rather than unfolded. Either way a fixed rule of the layer.
struct Conv2d {
  int in_channels = 0, out_channels = 0, kernel = 5, pad = 2, height = 0, width = 0;
  float *w = nullptr, *b = nullptr, *dw = nullptr, *db = nullptr;
  bool im2col_only = false;  // never oneDNN (bench/conv_engines's baseline)

  int64_t col_size() const { return int64_t(in_channels) * kernel * kernel * height * width; }
  // cols (n * col_size()) receives what backward reads: the unfolded input for
  // each image, or the input in oneDNN's layout. With kRelu, y = max(y, 0) as
  // well, image by image while in cache (oneDNN: in its pass).
  void Forward(const float* x, int n, float* cols, float* y, Activation activation = Activation::kNone) const;
  // dcol is scratch of col_size(); dx may be null for the first layer, and W
  // is read only for dx. accumulate as in Linear.
  void Backward(const float* cols, const float* dy, int n, float* dcol, float* dx, bool accumulate = false) const;
  // As Linear::BackwardSgd: every dx first (they need the old W), then the update.
  void BackwardSgd(const float* cols, const float* dy, int n, float* dcol, float* dx, float lr, float wd) const;
  // dx alone (the data half of Backward, for bench/conv_engines): col2im(Wᵀ·dY) image by image.
  void InputGradient(const float* dy, int n, float* dcol, float* dx) const;
};

// 2x2 max-pool, stride 2, on [n, c, h, w] (h and w even).
struct MaxPool2 {
  int channels = 0, height = 0, width = 0;  // input size
  // argmax[i] is the input index that produced output i.
  void Forward(const float* x, int n, float* y, int32_t* argmax) const;
  void Backward(const float* dy, const int32_t* argmax, int n, float* dx) const;
};

// Mean softmax cross-entropy over n rows of `classes` logits. Writes
// dlogits = grad_scale * (softmax - onehot) / n when dlogits is not null. When
// correct is not null, adds the number of rows whose argmax equals the label.
float SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int n, int classes, float* dlogits,
                          int64_t* correct = nullptr, float grad_scale = 1.0f);

}  // namespace estuary::models
