// Conv2d's passes on oneDNN's direct convolution (models/layers.h routes to
// it; internal to the models library).
//
// bench/conv_engines measures oneDNN's JIT direct convolution, in its blocked
// layouts (channels in blocks of 8 or 16) and with the reorders from and to
// the model's NCHW tensors, 1.4-1.5x faster than im2col + libxsmm on the CNN's
// conv2 (32 -> 64 channels) forward and backward-data, level on its
// backward-weights, and 5x slower on conv1 (one input channel) backward. So
// a layer whose channel counts are both multiples of 8 (conv2, not conv1)
// runs all three passes here: backward-weights too, so the forward keeps the
// input in oneDNN's layout for it instead of unfolding it.
//
// The choice is a fixed rule of the layer's shape, and oneDNN runs on one
// thread (OpenMP's count set to 1 on the calling thread), so a layer gets the
// same kernels, and the same bits, on every thread, at every thread count.
// Primitives are made once per (layer shape, batch) and kept in a per-thread
// table with their scratchpad and blocked buffers (grown, never shrunk), so a
// steady step allocates nothing of its own.
#pragma once

#include <cstdint>

namespace estuary::models {

struct Conv2d;

// Whether this build has oneDNN and `c` runs on it.
bool ConvOnDnnl(const Conv2d& c);

// y = conv(x) + b (then max(y, 0) with relu); keeps what backward reads in `keep`.
void DnnlConvForward(const Conv2d& c, const float* x, int n, float* keep, float* y, bool relu);

// dx = the input's gradient (when dx is not null, with the current W), then
// dw_plain [out, in, k, k] and db_plain [out] = the parameters' gradients
// (when dw_plain is not null), from what the forward kept and dy [n, out, h, w].
void DnnlConvBackward(const Conv2d& c, const float* keep, const float* dy, int n, float* dx, float* dw_plain,
                      float* db_plain);

}  // namespace estuary::models
