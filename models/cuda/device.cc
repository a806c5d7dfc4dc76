#include "models/cuda/device.h"

#include <utility>

#include "models/cuda/check.h"
#include "models/cuda/kernels.h"

namespace estuary::models::cuda {

Result<int> CudaDeviceCount() {
  int count = 0;
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  return count;
}

Status CudaUsable() {
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    (void)cudaGetLastError();
    return FailedPrecondition("no CUDA device: cudaGetDeviceCount returned {} ({})", cudaGetErrorName(e),
                              cudaGetErrorString(e));
  }
  if (count == 0) return FailedPrecondition("no CUDA device: cudaGetDeviceCount found 0 devices");
  int device = 0;
  cudaDeviceProp prop{};
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  if (const cudaError_t e = internal::ProbeKernelImage(); e != cudaSuccess) {
    (void)cudaGetLastError();
    return FailedPrecondition(
        "CUDA device {} ({}, sm_{}{}) cannot run estuary_cuda's kernels: {} ({}); rebuild with "
        "-DCMAKE_CUDA_ARCHITECTURES={}{}",
        device, prop.name, prop.major, prop.minor, cudaGetErrorName(e), cudaGetErrorString(e), prop.major,
        prop.minor);
  }
  return Status::Ok();
}

Result<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes) {
  if (bytes == 0) return DeviceBuffer();
  void* p = nullptr;
  if (const cudaError_t e = cudaMalloc(&p, bytes); e != cudaSuccess) {
    (void)cudaGetLastError();
    return Internal("cudaMalloc of {} bytes failed: {} ({})", bytes, cudaGetErrorName(e), cudaGetErrorString(e));
  }
  return DeviceBuffer(p, bytes);
}

DeviceBuffer::~DeviceBuffer() {
  // A destructor cannot report; cudaFree only fails on a context that is
  // already broken, and the next checked call will say so.
  if (data_) (void)cudaFree(data_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_) (void)cudaFree(data_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

Result<Arena> Arena::Create(size_t capacity_bytes) {
  Arena arena;
  ESTUARY_ASSIGN_OR_RETURN(arena.buffer_, DeviceBuffer::Allocate(capacity_bytes));
  return arena;
}

Result<void*> Arena::Allocate(size_t bytes) {
  // bytes <= free space bounds it well below SIZE_MAX, so the rounding cannot wrap.
  const size_t free = capacity() - used_;
  if (bytes > free || (bytes == 0 ? kAlignment : (bytes + kAlignment - 1) / kAlignment * kAlignment) > free) {
    return FailedPrecondition("cuda arena: {} bytes requested with {} of {} in use", bytes, used_, capacity());
  }
  void* p = static_cast<char*>(buffer_.data()) + used_;
  used_ += bytes == 0 ? kAlignment : (bytes + kAlignment - 1) / kAlignment * kAlignment;
  if (used_ > peak_) peak_ = used_;
  return p;
}

Result<PinnedBuffer> PinnedBuffer::Allocate(size_t bytes) {
  void* data = nullptr;
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaMallocHost(&data, bytes));
  return PinnedBuffer(data);
}

Result<Event> Event::Create() {
  cudaEvent_t event = nullptr;
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return Event(event);
}

Result<Stream> Stream::Create() {
  cudaStream_t stream = nullptr;
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return Stream(stream);
}

Status Stream::Synchronize() const {
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
  return Status::Ok();
}

Status CopyToDevice(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return Status::Ok();
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
  return Status::Ok();
}

Status CopyToHost(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return Status::Ok();
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return Status::Ok();
}

Status FillBytes(void* dst, int value, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return Status::Ok();
  ESTUARY_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, value, bytes, stream));
  return Status::Ok();
}

}  // namespace estuary::models::cuda
