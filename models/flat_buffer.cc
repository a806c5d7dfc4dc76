#include "models/flat_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace estuary::models {

size_t PageSize() {
  static const size_t size = size_t(sysconf(_SC_PAGESIZE));
  return size;
}

static size_t RoundUpToPages(size_t bytes) { return (bytes + PageSize() - 1) / PageSize() * PageSize(); }

void* MapPages(size_t bytes) {
  void* p = mmap(nullptr, RoundUpToPages(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::fprintf(stderr, "models: cannot map %zu bytes for a flat buffer: %s\n", bytes, std::strerror(errno));
    std::abort();
  }
  return p;
}

void UnmapPages(void* data, size_t bytes) { munmap(data, RoundUpToPages(bytes)); }

Result<size_t> ReleasePages(std::span<std::byte> bytes) {
  const uintptr_t page = PageSize();
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(bytes.data()) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(bytes.data()) + bytes.size()) / page * page;
  if (end <= begin) return size_t(0);
  if (madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED) != 0) {
    return IoError("models: madvise(MADV_DONTNEED) on {} bytes at {:#x}: {}", end - begin, begin,
                   std::strerror(errno));
  }
  return size_t(end - begin);
}

Result<size_t> ResidentBytes(std::span<const std::byte> bytes) {
  if (bytes.empty()) return size_t(0);
  const uintptr_t page = PageSize();
  const uintptr_t first = reinterpret_cast<uintptr_t>(bytes.data());
  const uintptr_t last = first + bytes.size();
  const uintptr_t begin = first / page * page;
  const size_t pages = (last - begin + page - 1) / page;
  std::vector<unsigned char> resident(pages);
  if (mincore(reinterpret_cast<void*>(begin), last - begin, resident.data()) != 0) {
    return IoError("models: mincore on {} bytes at {:#x}: {}", bytes.size(), first, std::strerror(errno));
  }
  size_t total = 0;
  for (size_t i = 0; i < pages; ++i) {
    if (!(resident[i] & 1)) continue;
    // Only the part of the page inside the range counts.
    const uintptr_t lo = std::max(first, begin + i * page), hi = std::min(last, begin + (i + 1) * page);
    total += hi - lo;
  }
  return total;
}

}  // namespace estuary::models
