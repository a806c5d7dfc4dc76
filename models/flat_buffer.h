// FlatBuffer: the memory of a model's flat parameter or gradient buffer.
//
// An anonymous private mmap, so the buffer starts on a page boundary and its
// pages belong to it alone: ZeRO-2/3 can hand the pages of a released range
// back to the OS (ReleasePages) and measure what stays resident
// (ResidentBytes) without disturbing a neighbour's allocation. Fresh pages
// read as zero and cost nothing until first written. Move-only; the memory
// does not move with the object, so pointers into it stay valid.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

#include "base/status.h"

namespace estuary::models {

size_t PageSize();

// `bytes` rounded up to whole pages, zeroed, page-aligned; aborts when the
// OS refuses (as operator new would throw): a model cannot exist without it.
void* MapPages(size_t bytes);
void UnmapPages(void* data, size_t bytes);

// Returns the pages lying wholly inside `bytes` to the OS (madvise
// MADV_DONTNEED); they read back as zeros when touched again. Partial pages
// at either end are left alone: they hold a neighbouring range's values.
// Returns the number of bytes released.
Result<size_t> ReleasePages(std::span<std::byte> bytes);
// The bytes of `bytes` that lie on pages resident in memory (mincore).
Result<size_t> ResidentBytes(std::span<const std::byte> bytes);

template <typename T>
Result<size_t> ReleasePages(std::span<T> range) {
  return ReleasePages(std::as_writable_bytes(range));
}
template <typename T>
Result<size_t> ResidentBytes(std::span<T> range) {
  return ResidentBytes(std::as_bytes(range));
}

template <typename T>
class FlatBuffer {
 public:
  FlatBuffer() = default;
  explicit FlatBuffer(size_t size)
      : data_(size ? static_cast<T*>(MapPages(size * sizeof(T))) : nullptr), size_(size) {}
  ~FlatBuffer() {
    if (data_) UnmapPages(data_, size_ * sizeof(T));
  }
  FlatBuffer(FlatBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  FlatBuffer& operator=(FlatBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    return *this;
  }
  FlatBuffer(const FlatBuffer&) = delete;
  FlatBuffer& operator=(const FlatBuffer&) = delete;

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }
  T* begin() { return data_; }
  T* end() { return data_ + size_; }
  const T* begin() const { return data_; }
  const T* end() const { return data_ + size_; }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }

 private:
  T* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace estuary::models
