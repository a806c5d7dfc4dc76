// BufferOps on a GPU: grid-stride kernels on the model's stream.
#include <cuda_runtime.h>

#include <fmt/format.h>

#include "parallel/buffer_ops.h"

namespace estuary::parallel {

namespace {

constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = 1024;

unsigned Blocks(size_t n) {
  size_t blocks = (n + kThreads - 1) / kThreads;
  return unsigned(blocks < 1 ? 1 : blocks > kMaxBlocks ? kMaxBlocks : blocks);
}

__device__ size_t First() { return size_t(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ size_t Stride() { return size_t(gridDim.x) * blockDim.x; }

__global__ void FillKernel(float* x, size_t n, float value) {
  for (size_t i = First(); i < n; i += Stride()) x[i] = value;
}
__global__ void AddKernel(float* dst, const float* src, size_t n) {
  for (size_t i = First(); i < n; i += Stride()) dst[i] += src[i];
}
__global__ void ScaleKernel(float* x, size_t n, float c) {
  for (size_t i = First(); i < n; i += Stride()) x[i] *= c;
}
__global__ void AddScaledDifferenceKernel(float* dst, const float* a, const float* b, size_t n, float c) {
  // __fmul_rn/__fadd_rn: no fused multiply-add, so the rounding is the host's.
  for (size_t i = First(); i < n; i += Stride()) dst[i] = __fadd_rn(dst[i], __fmul_rn(c, __fsub_rn(a[i], b[i])));
}
// Each block sums its share in double and adds it to *sum.
__global__ void SumSquaresKernel(const float* x, size_t n, double* sum) {
  __shared__ double partial[kThreads];
  double mine = 0;
  for (size_t i = First(); i < n; i += Stride()) mine += double(x[i]) * x[i];
  partial[threadIdx.x] = mine;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(sum, partial[0]);
}
// As models::UnscaleAndCheckFinite: every element is scaled; the check reads the value before.
__global__ void UnscaleKernel(float* x, size_t n, float inv_scale, int* found_inf) {
  bool bad = false;
  for (size_t i = First(); i < n; i += Stride()) {
    bad |= !isfinite(x[i]);
    x[i] *= inv_scale;
  }
  if (bad) *found_inf = 1;
}

#define OPS_CUDA(call)                                                                            \
  do {                                                                                            \
    const cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess) return Internal("data parallel: {} failed: {}", #call, cudaGetErrorString(e_)); \
  } while (0)

class CudaBufferOps : public BufferOps {
 public:
  explicit CudaBufferOps(cudaStream_t stream) : stream_(stream) {}
  ~CudaBufferOps() override { cudaFree(scratch_); }

  Status Init() {
    OPS_CUDA(cudaMalloc(&scratch_, 64));
    return Status::Ok();
  }

  Result<std::shared_ptr<float>> Allocate(size_t n) override {
    float* p = nullptr;
    OPS_CUDA(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(n, 1) * sizeof(float)));
    std::shared_ptr<float> owned(p, [](float* q) { cudaFree(q); });
    OPS_CUDA(cudaMemsetAsync(p, 0, std::max<size_t>(n, 1) * sizeof(float), stream_));
    return owned;
  }
  Result<std::shared_ptr<double>> AllocateDoubles(size_t n) override {
    double* p = nullptr;
    OPS_CUDA(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(n, 1) * sizeof(double)));
    std::shared_ptr<double> owned(p, [](double* q) { cudaFree(q); });
    OPS_CUDA(cudaMemsetAsync(p, 0, std::max<size_t>(n, 1) * sizeof(double), stream_));
    return owned;
  }
  Status Copy(float* dst, const float* src, size_t n) override {
    if (n > 0) OPS_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    return Status::Ok();
  }
  Status Fill(float* dst, size_t n, float value) override {
    if (n == 0) return Status::Ok();
    FillKernel<<<Blocks(n), kThreads, 0, stream_>>>(dst, n, value);
    OPS_CUDA(cudaGetLastError());
    return Status::Ok();
  }
  Status Add(float* dst, const float* src, size_t n) override {
    if (n == 0) return Status::Ok();
    AddKernel<<<Blocks(n), kThreads, 0, stream_>>>(dst, src, n);
    OPS_CUDA(cudaGetLastError());
    return Status::Ok();
  }
  Status Scale(float* x, size_t n, float c) override {
    if (n == 0) return Status::Ok();
    ScaleKernel<<<Blocks(n), kThreads, 0, stream_>>>(x, n, c);
    OPS_CUDA(cudaGetLastError());
    return Status::Ok();
  }
  Status AddScaledDifference(float* dst, const float* a, const float* b, size_t n, float c) override {
    if (n == 0) return Status::Ok();
    AddScaledDifferenceKernel<<<Blocks(n), kThreads, 0, stream_>>>(dst, a, b, n, c);
    OPS_CUDA(cudaGetLastError());
    return Status::Ok();
  }
  Result<double> SumSquares(const BufferPieces& pieces) override {
    double* sum = static_cast<double*>(scratch_);
    OPS_CUDA(cudaMemsetAsync(sum, 0, sizeof(double), stream_));
    for (const BufferPiece& x : pieces) {
      if (x.size == 0) continue;
      SumSquaresKernel<<<Blocks(x.size), kThreads, 0, stream_>>>(x.data, x.size, sum);
      OPS_CUDA(cudaGetLastError());
    }
    double host = 0;
    OPS_CUDA(cudaMemcpyAsync(&host, sum, sizeof host, cudaMemcpyDeviceToHost, stream_));
    OPS_CUDA(cudaStreamSynchronize(stream_));
    return host;
  }
  Result<bool> UnscaleAndCheckFinite(const BufferPieces& pieces, float inv_scale) override {
    int* flag = static_cast<int*>(scratch_) + 4;
    OPS_CUDA(cudaMemsetAsync(flag, 0, sizeof(int), stream_));
    for (const BufferPiece& x : pieces) {
      if (x.size == 0) continue;
      UnscaleKernel<<<Blocks(x.size), kThreads, 0, stream_>>>(x.data, x.size, inv_scale, flag);
      OPS_CUDA(cudaGetLastError());
    }
    int host = 0;
    OPS_CUDA(cudaMemcpyAsync(&host, flag, sizeof host, cudaMemcpyDeviceToHost, stream_));
    OPS_CUDA(cudaStreamSynchronize(stream_));
    return host != 0;
  }
  Status CopyDoubles(double* dst, const double* src, size_t n) override {
    if (n == 0) return Status::Ok();
    OPS_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(double), cudaMemcpyDefault, stream_));
    OPS_CUDA(cudaStreamSynchronize(stream_));
    return Status::Ok();
  }

 private:
  cudaStream_t stream_;
  void* scratch_ = nullptr;  // a double sum at 0, a found-inf flag at +16
};

}  // namespace

Result<std::unique_ptr<BufferOps>> MakeCudaBufferOps(void* stream) {
  if (!stream) return InvalidArgument("data parallel: buffers on a GPU need the model's stream (device_stream)");
  auto ops = std::make_unique<CudaBufferOps>(static_cast<cudaStream_t>(stream));
  ESTUARY_RETURN_IF_ERROR(ops->Init());
  return std::unique_ptr<BufferOps>(std::move(ops));
}

}  // namespace estuary::parallel
