// Device memory and execution for the CUDA backend.
//
// DeviceBuffer owns one cudaMalloc allocation on the current device and frees
// it when destroyed; it moves, never copies. An Arena is a bump allocator over
// one DeviceBuffer: a training step takes its temporaries from it and calls
// Reset() at the end, so the loop itself never calls cudaMalloc. Stream owns a
// non-blocking stream. Every fallible call returns a Status or Result that
// carries the CUDA error (models/cuda/check.h); nothing aborts.
//
// CudaUsable() says whether this library's kernels can run here, and if not,
// why; tests skip with that reason:
//   if (Status s = CudaUsable(); !s.ok()) GTEST_SKIP() << s.message();
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "base/status.h"

namespace estuary::models::cuda {

// The number of visible CUDA devices, or the runtime's error.
Result<int> CudaDeviceCount();

// Ok when there is a device and the kernels built into this library (see
// CMAKE_CUDA_ARCHITECTURES) have an image it can run; otherwise the reason,
// e.g. "no CUDA device: cudaGetDeviceCount returned cudaErrorNoDevice (...)".
Status CudaUsable();

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // Zero bytes gives an empty buffer without touching the device.
  static Result<DeviceBuffer> Allocate(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }
  size_t size() const { return bytes_; }

 private:
  DeviceBuffer(void* data, size_t bytes) : data_(data), bytes_(bytes) {}
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

class Arena {
 public:
  // Every allocation is aligned to this, so vectorised kernels accept any of them.
  static constexpr size_t kAlignment = 256;

  Arena() = default;
  static Result<Arena> Create(size_t capacity_bytes);

  // Fails (naming the request, the bytes in use and the capacity) rather than
  // growing: a step that needs more must say so up front.
  Result<void*> Allocate(size_t bytes);
  template <typename T>
  Result<T*> Allocate(int64_t count);
  // Releases everything at once. Only safe when no enqueued kernel still uses
  // the memory (or when later users are on the same stream, which orders them).
  void Reset() { used_ = 0; }

  size_t used() const { return used_; }
  size_t peak() const { return peak_; }
  size_t capacity() const { return buffer_.size(); }

 private:
  DeviceBuffer buffer_;
  size_t used_ = 0, peak_ = 0;
};

class Stream {
 public:
  Stream() = default;
  static Result<Stream> Create();
  ~Stream();
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  cudaStream_t get() const { return stream_; }
  Status Synchronize() const;

 private:
  explicit Stream(cudaStream_t stream) : stream_(stream) {}
  cudaStream_t stream_ = nullptr;
};

// Host -> device, enqueued on `stream`; `src` may be reused on return.
Status CopyToDevice(void* dst, const void* src, size_t bytes, cudaStream_t stream);
// Device -> host: waits for `stream`, so `dst` holds the data on return.
Status CopyToHost(void* dst, const void* src, size_t bytes, cudaStream_t stream);
// Sets `bytes` bytes to `value`, enqueued on `stream`.
Status FillBytes(void* dst, int value, size_t bytes, cudaStream_t stream);

template <typename T>
Result<T*> Arena::Allocate(int64_t count) {
  if (count < 0 || uint64_t(count) > SIZE_MAX / sizeof(T)) {
    return InvalidArgument("cuda arena: cannot allocate {} elements of {} bytes", count, sizeof(T));
  }
  ESTUARY_ASSIGN_OR_RETURN(void* p, Allocate(size_t(count) * sizeof(T)));
  return static_cast<T*>(p);
}

}  // namespace estuary::models::cuda
