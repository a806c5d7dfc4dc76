#include "parallel/buffer_ops.h"

#include <algorithm>
#include <cstring>
#include <span>

#include "models/loss_scaler.h"

namespace estuary::parallel {

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
  Status AddScaledDifference(float* dst, const float* a, const float* b, size_t n, float c) override {
    for (size_t i = 0; i < n; ++i) dst[i] += c * (a[i] - b[i]);
    return Status::Ok();
  }
  Result<double> SumSquares(const BufferPieces& pieces) override {
    double sum = 0;
    for (const BufferPiece& x : pieces) {
      for (size_t i = 0; i < x.size; ++i) sum += double(x.data[i]) * x.data[i];
    }
    return sum;
  }
  Result<bool> UnscaleAndCheckFinite(const BufferPieces& pieces, float inv_scale) override {
    bool found = false;
    for (const BufferPiece& x : pieces) {  // every piece is scaled, found or not
      found |= models::UnscaleAndCheckFinite(std::span<float>(x.data, x.size), inv_scale);
    }
    return found;
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

}  // namespace estuary::parallel
