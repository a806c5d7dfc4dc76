#include "client/buffer_ops.h"

#include <algorithm>
#include <cstring>
#include <span>

#include "models/loss_scaler.h"

namespace estuary::client {

namespace {

class HostBufferOps : public BufferOps {
 public:
  Result<std::shared_ptr<float>> Allocate(size_t n) override {
    return std::shared_ptr<float>(new float[std::max<size_t>(n, 1)](), std::default_delete<float[]>());
  }
  Result<std::shared_ptr<double>> AllocateDoubles(size_t n) override {
    return std::shared_ptr<double>(new double[std::max<size_t>(n, 1)](), std::default_delete<double[]>());
  }
  Status Copy(float* dst, const float* src, size_t n) override {
    if (n > 0) std::memcpy(dst, src, n * sizeof(float));
    return Status::Ok();
  }
  Status Fill(float* dst, size_t n, float value) override {
    std::fill(dst, dst + n, value);
    return Status::Ok();
  }
  Status Add(float* dst, const float* src, size_t n) override {
    for (size_t i = 0; i < n; ++i) dst[i] += src[i];
    return Status::Ok();
  }
  Status Scale(float* x, size_t n, float c) override {
    for (size_t i = 0; i < n; ++i) x[i] *= c;
    return Status::Ok();
  }
  Result<double> SumSquares(const float* x, size_t n) override {
    double sum = 0;
    for (size_t i = 0; i < n; ++i) sum += double(x[i]) * x[i];
    return sum;
  }
  Result<bool> UnscaleAndCheckFinite(float* x, size_t n, float inv_scale) override {
    return models::UnscaleAndCheckFinite(std::span<float>(x, n), inv_scale);
  }
  Status CopyDoubles(double* dst, const double* src, size_t n) override {
    if (n > 0) std::memcpy(dst, src, n * sizeof(double));
    return Status::Ok();
  }
};

}  // namespace

std::unique_ptr<BufferOps> MakeHostBufferOps() { return std::make_unique<HostBufferOps>(); }

#ifndef ESTUARY_DATA_PARALLEL_CUDA
Result<std::unique_ptr<BufferOps>> MakeCudaBufferOps(void*) {
  return FailedPrecondition("data parallel: buffers on a GPU, but this build has no CUDA");
}
#endif

}  // namespace estuary::client
