// Mixed precision on the GPU: the flat fp32 master weights converted to the
// bf16/fp16 working copy (and back), and the loss scaler's unscale pass.
//
// Conversions round to nearest even with NaN and ±inf kept, as the CPU
// reference models/precision.h (bit for bit on every non-NaN value). The
// unscale pass is the device half of models::LossScaler: it multiplies the
// flat gradient buffer by inv_scale and raises a device flag when any
// gradient was inf or NaN; ReadFoundInf() brings that flag to the host, the
// one synchronisation a mixed-precision step needs, and its value feeds
// LossScaler::Update() and decides whether the optimizer step runs.
// All calls are enqueued on `stream` and return once the work is queued.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "base/status.h"
#include "models/tensor.h"

namespace estuary::models::cuda {

// dst[i] = src[i] for i < count, from f32 to bf16/f16 or from bf16/f16 to f32.
Status Convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t count, cudaStream_t stream);

// grads *= inv_scale; *found_inf (one device float) becomes 1 when any
// gradient was non-finite before scaling, else 0 (it is reset first).
Status UnscaleAndCheckFinite(float* grads, int64_t count, float inv_scale, float* found_inf, cudaStream_t stream);

// Waits for `stream` and returns the flag that UnscaleAndCheckFinite wrote.
Result<bool> ReadFoundInf(const float* found_inf, cudaStream_t stream);

}  // namespace estuary::models::cuda
