// The CPU layers' building blocks (models/layers.h) on the GPU, fp32.
//
// Same layouts and semantics as the CPU ops, which serve as their reference:
// a Linear or Conv2d is BroadcastBias + Gemm (blas.h) forward and Gemm +
// BiasGradient (+ Col2Im) backward; Im2Col lays out a batch of images as
// models::Conv2d::Forward does, [n][c*k*k][h*w]. Outputs are overwritten,
// never accumulated. Every call checks its sizes (int64 products, no
// overflow), enqueues on `stream` and returns without waiting; device
// pointers must hold the sizes stated.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "base/status.h"
#include "models/cuda/device.h"

namespace estuary::models::cuda {

// y[o][c][i] = bias[c] over [outer, channels, inner]: the starting value a
// GEMM with beta = 1 adds onto (Linear: inner = 1; Conv2d: inner = h*w).
Status BroadcastBias(const float* bias, int64_t outer, int64_t channels, int64_t inner, float* y,
                     cudaStream_t stream);
// dbias[c] = sum over o, i of dy[o][c][i] (accumulated in double).
Status BiasGradient(const float* dy, int64_t outer, int64_t channels, int64_t inner, float* dbias,
                    cudaStream_t stream);

// In place: x = max(x, 0), as models::ReluForward.
Status ReluForward(float* x, int64_t count, cudaStream_t stream);
// dy = dy where y > 0, else 0; in place on dy, as models::ReluBackward.
Status ReluBackward(const float* y, float* dy, int64_t count, cudaStream_t stream);

// Conv2d geometry: stride 1, zero padding `pad`, square kernel k, [n, c, h, w].
struct ConvShape {
  int n = 0, channels = 0, height = 0, width = 0, kernel = 5, pad = 2;
};
// cols [n][c*k*k][h*w] from x [n][c][h][w].
Status Im2Col(const float* x, const ConvShape& shape, float* cols, cudaStream_t stream);
// The adjoint: dx [n][c][h][w] = the sum of the cols entries copied from each place.
Status Col2Im(const float* cols, const ConvShape& shape, float* dx, cudaStream_t stream);

// 2x2 max-pool, stride 2, on [n, c, h, w] with h and w even; argmax[i] is the
// input index (over the whole batch) that produced output i, ties to the first.
Status MaxPool2Forward(const float* x, int n, int channels, int height, int width, float* y, int32_t* argmax,
                       cudaStream_t stream);
// dx (the input's size) = dy routed to the argmax positions, zero elsewhere.
Status MaxPool2Backward(const float* dy, const int32_t* argmax, int n, int channels, int height, int width, float* dx,
                        cudaStream_t stream);

// models::SoftmaxCrossEntropy, fused: *loss (a device float) = the mean over
// n rows of `classes` logits; dlogits = (softmax - onehot) / n × grad_scale
// when not null;
// *correct (a device int64) += rows whose first argmax is the label, when not
// null. A label outside [0, classes) makes its row's loss and gradient NaN
// rather than read out of bounds (so the step's loss is NaN). Scratch of
// 8 bytes per row comes from `arena`.
Status SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int n, int classes, float* dlogits,
                           float* loss, int64_t* correct, Arena& arena, cudaStream_t stream, float grad_scale = 1.0f);

}  // namespace estuary::models::cuda
