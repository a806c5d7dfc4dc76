// Device memory and execution for the CUDA backend.
//
// DeviceBuffer owns one cudaMalloc allocation on the current device and frees
// it when destroyed; it moves, never copies. An Arena is a bump allocator over
// one DeviceBuffer: a training step takes its temporaries from it and calls
// Reset() at the end, so the loop itself never calls cudaMalloc. Stream owns a
// non-blocking stream, Event an event and PinnedBuffer page-locked host
// memory, each through a UniqueHandle. Every fallible call returns a Status or Result that
// carries the CUDA error (models/cuda/check.h); nothing aborts.
//
// CudaUsable() says whether this library's kernels can run here, and if not,
// why; tests skip with that reason:
//   if (Status s = CudaUsable(); !s.ok()) GTEST_SKIP() << s.message();
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <utility>

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

// Owns one CUDA runtime handle (null: none) and gives it back with Release
// when destroyed or assigned over; moves, never copies. A destructor cannot
// report: Release fails only on a broken context, which the next checked call
// reports.
template <typename Handle, auto Release>
class UniqueHandle {
 public:
  UniqueHandle() = default;
  explicit UniqueHandle(Handle handle) : handle_(handle) {}
  ~UniqueHandle() { Reset(); }
  UniqueHandle(UniqueHandle&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  UniqueHandle& operator=(UniqueHandle&& other) noexcept {
    if (this != &other) {
      Reset();
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  UniqueHandle(const UniqueHandle&) = delete;
  UniqueHandle& operator=(const UniqueHandle&) = delete;

  Handle get() const { return handle_; }

 private:
  void Reset() {
    if (handle_) (void)Release(handle_);
    handle_ = nullptr;
  }
  Handle handle_ = nullptr;
};

class Stream {
 public:
  Stream() = default;
  static Result<Stream> Create();

  cudaStream_t get() const { return stream_.get(); }
  Status Synchronize() const;

 private:
  explicit Stream(cudaStream_t stream) : stream_(stream) {}
  UniqueHandle<cudaStream_t, cudaStreamDestroy> stream_;
};

// Page-locked host memory (cudaMallocHost), so host<->device copies of
// batches run asynchronously; freed on destruction.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  static Result<PinnedBuffer> Allocate(size_t bytes);
  template <typename T>
  T* as() const { return static_cast<T*>(data_.get()); }

 private:
  explicit PinnedBuffer(void* data) : data_(data) {}
  UniqueHandle<void*, cudaFreeHost> data_;
};

// A CUDA event without timing (the cheap kind), for ordering host reuse of a
// staging buffer after the copy that reads it.
class Event {
 public:
  Event() = default;
  static Result<Event> Create();
  cudaEvent_t get() const { return event_.get(); }

 private:
  explicit Event(cudaEvent_t event) : event_(event) {}
  UniqueHandle<cudaEvent_t, cudaEventDestroy> event_;
};

// Hands out consecutive slices of one device buffer, each Arena::kAlignment
// aligned, for the fixed layouts an engine carves once at creation. With a
// null base it only measures, so the same code sizes the buffer and then
// fills in the pointers.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  void* Take(int64_t count, size_t element_bytes) {
    void* p = base_ ? base_ + used_ : nullptr;
    used_ += (size_t(count) * element_bytes + Arena::kAlignment - 1) / Arena::kAlignment * Arena::kAlignment;
    return p;
  }
  float* Floats(int64_t count) { return static_cast<float*>(Take(count, sizeof(float))); }
  int32_t* Ints(int64_t count) { return static_cast<int32_t*>(Take(count, sizeof(int32_t))); }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
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
