// Kernels of the CPU layers in models/layers.cc: bias broadcast and gradient,
// im2col / col2im, 2x2 max-pool and the fused softmax cross-entropy. Each one
// reproduces its CPU counterpart's indexing and tie rules; the gathers
// (col2im, the pool's backward, the reductions) make every output the work of
// one thread, so there are no atomics and results do not vary run to run.
#include <cfloat>
#include <climits>
#include <cmath>

#include "models/cuda/kernel_common.cuh"

namespace estuary::models::cuda::internal {
namespace {

__global__ void BroadcastBiasKernel(const float* bias, int64_t channels, int64_t inner, int64_t total, float* y) {
  for (int64_t i = FirstIndex(); i < total; i += Stride()) y[i] = bias[(i / inner) % channels];
}

// One block per channel (grid-striding over channels), a fixed tree inside.
__global__ void __launch_bounds__(kThreads)
    BiasGradientKernel(const float* dy, int64_t outer, int64_t channels, int64_t inner, float* dbias) {
  __shared__ double shared[kThreads];
  const int64_t per_channel = outer * inner;
  for (int64_t c = blockIdx.x; c < channels; c += gridDim.x) {
    double sum = 0;
    for (int64_t j = threadIdx.x; j < per_channel; j += blockDim.x) {
      const int64_t o = j / inner, i = j - o * inner;
      sum += dy[(o * channels + c) * inner + i];
    }
    shared[threadIdx.x] = sum;
    __syncthreads();
    for (int half = kThreads / 2; half > 0; half /= 2) {
      if (int(threadIdx.x) < half) shared[threadIdx.x] += shared[threadIdx.x + half];
      __syncthreads();
    }
    if (threadIdx.x == 0) dbias[c] = float(shared[0]);
    __syncthreads();  // shared is reused by the next channel
  }
}

// cols[img][(ch * k + ky) * k + kx][y * w + x] = x[img][ch][y + ky - pad][x + kx - pad], zero outside.
__global__ void Im2ColKernel(const float* x, int c, int h, int w, int k, int pad, int64_t total, float* cols) {
  const int64_t hw = int64_t(h) * w, rows = int64_t(c) * k * k;
  for (int64_t i = FirstIndex(); i < total; i += Stride()) {
    const int64_t p = i % hw, row = (i / hw) % rows, img = i / (hw * rows);
    const int ch = int(row / (k * k)), ky = int(row / k % k), kx = int(row % k);
    const int sy = int(p / w) + ky - pad, sx = int(p % w) + kx - pad;
    cols[i] = (sy >= 0 && sy < h && sx >= 0 && sx < w) ? x[((img * c + ch) * h + sy) * w + sx] : 0.0f;
  }
}

// The adjoint, as a gather: dx[img][ch][sy][sx] sums the cols entries that
// Im2Col copied from there, in the CPU's order (ky, then kx).
__global__ void Col2ImKernel(const float* cols, int c, int h, int w, int k, int pad, int64_t total, float* dx) {
  const int64_t hw = int64_t(h) * w, rows = int64_t(c) * k * k;
  for (int64_t i = FirstIndex(); i < total; i += Stride()) {
    const int sx = int(i % w), sy = int(i / w % h);
    const int64_t plane = i / hw, ch = plane % c, img = plane / c;
    const float* col = cols + (img * rows + ch * k * k) * hw;
    float sum = 0.0f;
    for (int ky = 0; ky < k; ++ky) {
      const int y = sy - ky + pad;
      if (y < 0 || y >= h) continue;
      for (int kx = 0; kx < k; ++kx) {
        const int x = sx - kx + pad;
        if (x < 0 || x >= w) continue;
        sum += col[(int64_t(ky) * k + kx) * hw + int64_t(y) * w + x];
      }
    }
    dx[i] = sum;
  }
}

__global__ void MaxPool2ForwardKernel(const float* x, int h, int w, int64_t outputs, float* y, int32_t* argmax) {
  const int oh = h / 2, ow = w / 2;
  for (int64_t i = FirstIndex(); i < outputs; i += Stride()) {
    const int64_t plane = i / (int64_t(oh) * ow);
    const int r = int(i / ow % oh), col = int(i % ow);
    const float* in = x + plane * h * w;
    int best = 2 * r * w + 2 * col;
    // Ties go to the first element in row-major order, as models::MaxPool2 and PyTorch.
    const int candidates[3] = {best + 1, best + w, best + w + 1};
    for (int candidate : candidates) {
      if (in[candidate] > in[best]) best = candidate;
    }
    y[i] = in[best];
    argmax[i] = int32_t(plane * h * w + best);  // the host checked that this fits
  }
}

// Each output owns its 2x2 window of dx (windows do not overlap): the argmax
// gets dy, the other three get zero. An argmax outside its window (corrupt
// input) drops that gradient instead of writing out of bounds.
__global__ void MaxPool2BackwardKernel(const float* dy, const int32_t* argmax, int h, int w, int64_t outputs,
                                       float* dx) {
  const int oh = h / 2, ow = w / 2;
  for (int64_t i = FirstIndex(); i < outputs; i += Stride()) {
    const int64_t plane = i / (int64_t(oh) * ow);
    const int r = int(i / ow % oh), col = int(i % ow);
    const int64_t top_left = plane * h * w + int64_t(2 * r) * w + 2 * col;
    const int64_t window[4] = {top_left, top_left + 1, top_left + w, top_left + w + 1};
    for (int64_t index : window) dx[index] = index == argmax[i] ? dy[i] : 0.0f;
  }
}

// One warp per row. Reductions go down to lane 0 and are broadcast from it,
// so every lane uses the same bits.
__global__ void __launch_bounds__(kThreads)
    SoftmaxCrossEntropyRowsKernel(const float* logits, const int32_t* labels, int n, int classes, float* dlogits,
                                  float grad_scale, float* row_loss, int32_t* row_correct) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = Stride() / 32;
  for (int64_t row = FirstIndex() / 32; row < n; row += warps) {
    const float* z = logits + row * classes;
    float best = -INFINITY;
    int arg = INT_MAX;
    for (int c = lane; c < classes; c += 32) {
      if (arg == INT_MAX || z[c] > best) best = z[c], arg = c;
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other = __shfl_down_sync(0xffffffffu, best, offset);
      const int other_arg = __shfl_down_sync(0xffffffffu, arg, offset);
      // The first maximum wins, as the CPU's strict > scan from index 0.
      if (other_arg != INT_MAX && (arg == INT_MAX || other > best || (other == best && other_arg < arg))) {
        best = other, arg = other_arg;
      }
    }
    const float max = __shfl_sync(0xffffffffu, best, 0);
    arg = __shfl_sync(0xffffffffu, arg, 0);
    float sum = 0.0f;
    for (int c = lane; c < classes; c += 32) sum += expf(z[c] - max);
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
    const float log_sum = logf(__shfl_sync(0xffffffffu, sum, 0));
    const int label = labels[row];
    // A label out of range would index past the row: its loss and gradient become NaN instead.
    const bool valid = label >= 0 && label < classes;
    if (lane == 0) {
      row_loss[row] = valid ? log_sum - (z[label] - max) : NAN;
      row_correct[row] = valid && arg == label;
    }
    if (dlogits) {
      float* d = dlogits + row * classes;
      for (int c = lane; c < classes; c += 32) {
        const float p = expf((z[c] - max) - log_sum);
        // Scaled after the division, so grad_scale 1 gives the same bits as no scale.
        d[c] = valid ? (p - (c == label ? 1.0f : 0.0f)) / float(n) * grad_scale : NAN;
      }
    }
  }
}

constexpr int kReduceThreads = 1024;

__global__ void __launch_bounds__(kReduceThreads)
    MeanLossKernel(const float* row_loss, const int32_t* row_correct, int n, float* loss, int64_t* correct) {
  __shared__ double loss_sum[kReduceThreads];
  __shared__ int64_t correct_sum[kReduceThreads];
  double l = 0;
  int64_t k = 0;
  for (int i = threadIdx.x; i < n; i += kReduceThreads) l += row_loss[i], k += row_correct[i];
  loss_sum[threadIdx.x] = l;
  correct_sum[threadIdx.x] = k;
  __syncthreads();
  for (int half = kReduceThreads / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) {
      loss_sum[threadIdx.x] += loss_sum[threadIdx.x + half];
      correct_sum[threadIdx.x] += correct_sum[threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *loss = float(loss_sum[0] / n);
    if (correct) *correct += correct_sum[0];
  }
}

}  // namespace

cudaError_t BroadcastBias(const float* bias, int64_t outer, int64_t channels, int64_t inner, float* y,
                          cudaStream_t s) {
  const int64_t total = outer * channels * inner;
  if (total <= 0) return cudaSuccess;
  BroadcastBiasKernel<<<unsigned(Blocks(total)), kThreads, 0, s>>>(bias, channels, inner, total, y);
  return cudaGetLastError();
}

cudaError_t BiasGradient(const float* dy, int64_t outer, int64_t channels, int64_t inner, float* dbias,
                         cudaStream_t s) {
  if (channels <= 0) return cudaSuccess;
  const int64_t blocks = channels < kMaxBlocks ? channels : kMaxBlocks;
  BiasGradientKernel<<<unsigned(blocks), kThreads, 0, s>>>(dy, outer, channels, inner, dbias);
  return cudaGetLastError();
}

cudaError_t Im2Col(const float* x, int n, int c, int h, int w, int k, int pad, float* cols, cudaStream_t s) {
  const int64_t total = int64_t(n) * c * k * k * h * w;
  if (total <= 0) return cudaSuccess;
  Im2ColKernel<<<unsigned(Blocks(total)), kThreads, 0, s>>>(x, c, h, w, k, pad, total, cols);
  return cudaGetLastError();
}

cudaError_t Col2Im(const float* cols, int n, int c, int h, int w, int k, int pad, float* dx, cudaStream_t s) {
  const int64_t total = int64_t(n) * c * h * w;
  if (total <= 0) return cudaSuccess;
  Col2ImKernel<<<unsigned(Blocks(total)), kThreads, 0, s>>>(cols, c, h, w, k, pad, total, dx);
  return cudaGetLastError();
}

cudaError_t MaxPool2Forward(const float* x, int n, int c, int h, int w, float* y, int32_t* argmax, cudaStream_t s) {
  const int64_t outputs = int64_t(n) * c * (h / 2) * (w / 2);
  if (outputs <= 0) return cudaSuccess;
  MaxPool2ForwardKernel<<<unsigned(Blocks(outputs)), kThreads, 0, s>>>(x, h, w, outputs, y, argmax);
  return cudaGetLastError();
}

cudaError_t MaxPool2Backward(const float* dy, const int32_t* argmax, int n, int c, int h, int w, float* dx,
                             cudaStream_t s) {
  const int64_t outputs = int64_t(n) * c * (h / 2) * (w / 2);
  if (outputs <= 0) return cudaSuccess;
  MaxPool2BackwardKernel<<<unsigned(Blocks(outputs)), kThreads, 0, s>>>(dy, argmax, h, w, outputs, dx);
  return cudaGetLastError();
}

cudaError_t SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int n, int classes, float* dlogits,
                                float grad_scale, float* row_loss, int32_t* row_correct, float* loss,
                                int64_t* correct, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  SoftmaxCrossEntropyRowsKernel<<<unsigned(Blocks(int64_t(n) * 32)), kThreads, 0, s>>>(
      logits, labels, n, classes, dlogits, grad_scale, row_loss, row_correct);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  MeanLossKernel<<<1, kReduceThreads, 0, s>>>(row_loss, row_correct, n, loss, correct);
  return cudaGetLastError();
}

}  // namespace estuary::models::cuda::internal
