// Kernel launchers behind the public headers of models/cuda (internal).
//
// The .cu files hold only device code and these launchers; the .cc files
// validate arguments, then turn the cudaError_t each launcher returns into a
// Status. The split exists because nvcc 13 cannot compile fmt 9's consteval
// format strings, so nothing here may include base/status.h. Every launcher
// returns cudaGetLastError() after its launch(es), computes grid sizes in 64
// bits, and assumes the caller checked sizes, pointers and alignment: `vec`
// promises that every float pointer is 16-byte and every 16-bit pointer
// 8-byte aligned, so the kernels may move four elements per access.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace estuary::models::cuda::internal {

inline bool IsAligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Mirrors DType (checked by static_assert in the .cc files); kNone: no output.
enum class Kind : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 255 };

constexpr int kThreads = 256;
// Grid-stride loops need no more blocks than this to fill a GPU (132 SMs x 8 x 256
// threads on an H100 is ~270k threads); bigger inputs loop.
constexpr int64_t kMaxBlocks = 4096;
// Partial sums in the two-pass norm: a fixed count, so the result does not
// depend on the device and is the same run to run.
constexpr int kNormBlocks = 1024;

// Whether this library's kernels have an image the current device can run.
cudaError_t ProbeKernelImage();

// dst[i] = src[i] converted; pairs: f32 -> bf16/f16, bf16/f16 -> f32.
cudaError_t Convert(const void* src, Kind src_kind, void* dst, Kind dst_kind, int64_t n, bool vec, cudaStream_t s);
// grads *= inv_scale; *found_inf = 1 when any value was non-finite before (never cleared here).
cudaError_t UnscaleAndCheck(float* grads, int64_t n, float inv_scale, float* found_inf, bool vec, cudaStream_t s);

// Scalars of one AdamW step, each rounded to fp32 once on the host (in double).
struct AdamWArgs {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
  float decay;                  // 1 - lr * weight_decay
  float step_size;              // lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
};
// One AdamW step over flat buffers; working (if kind != kNone) receives the new params.
cudaError_t AdamWStep(float* params, const float* grads, float* exp_avg, float* exp_avg_sq, int64_t n,
                      const AdamWArgs& args, void* working, Kind working_kind, bool vec, cudaStream_t s);
// One SGD step (models::Sgd); momentum_buffer null when momentum == 0; first: initialise it.
cudaError_t SgdStep(float* params, const float* grads, float* momentum_buffer, int64_t n, float lr, float momentum,
                    float weight_decay, bool first, void* working, Kind working_kind, bool vec, cudaStream_t s);

// partials[kNormBlocks] = per-block sums of grads^2.
cudaError_t SquaredNormPartials(const float* grads, int64_t n, double* partials, bool vec, cudaStream_t s);
// *norm = sqrt(sum partials); *coef = min(max_norm / (norm + 1e-6), 1), in double as models::ClipGradNorm.
cudaError_t ClipCoefficient(const double* partials, double max_norm, double* norm, float* coef, cudaStream_t s);
// grads *= *coef (read on the device: no host round trip).
cudaError_t ScaleByDeviceScalar(float* grads, int64_t n, const float* coef, bool vec, cudaStream_t s);

cudaError_t ReluForward(float* x, int64_t n, bool vec, cudaStream_t s);
cudaError_t ReluBackward(const float* y, float* dy, int64_t n, bool vec, cudaStream_t s);
// y[o, c, i] = bias[c] over [outer, channels, inner].
cudaError_t BroadcastBias(const float* bias, int64_t outer, int64_t channels, int64_t inner, float* y,
                          cudaStream_t s);
// dbias[c] = sum over o, i of dy[o, c, i].
cudaError_t BiasGradient(const float* dy, int64_t outer, int64_t channels, int64_t inner, float* dbias,
                         cudaStream_t s);
cudaError_t Im2Col(const float* x, int n, int c, int h, int w, int k, int pad, float* cols, cudaStream_t s);
cudaError_t Col2Im(const float* cols, int n, int c, int h, int w, int k, int pad, float* dx, cudaStream_t s);
cudaError_t MaxPool2Forward(const float* x, int n, int c, int h, int w, float* y, int32_t* argmax, cudaStream_t s);
cudaError_t MaxPool2Backward(const float* dy, const int32_t* argmax, int n, int c, int h, int w, float* dx,
                             cudaStream_t s);
// Per row: row_loss, row_correct, dlogits (if not null); then one block reduces
// them into *loss (mean) and adds the correct count to *correct (if not null).
cudaError_t SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int n, int classes, float* dlogits,
                                float grad_scale, float* row_loss, int32_t* row_correct, float* loss,
                                int64_t* correct, cudaStream_t s);

}  // namespace estuary::models::cuda::internal
