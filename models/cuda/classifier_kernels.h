// Kernel launchers behind models/cuda/classifier_engine.cc (internal), under
// the rules of kernels.h: no base/status.h here (nvcc cannot compile fmt's
// consteval format strings), the caller checks sizes and pointers, and each
// launcher returns cudaGetLastError() after its launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace estuary::models::cuda::internal {

// out[j] = sum over i < n of partials[i * count + j], added in order i = 0,
// 1, ... in fp32: the order in which models::Conv2d::Backward accumulates its
// per-image weight gradients (GEMMs with beta = 1), and deterministic.
cudaError_t SumOverBatch(const float* partials, int64_t n, int64_t count, float* out, cudaStream_t s);

}  // namespace estuary::models::cuda::internal
