// Keeps freed large buffers in the process instead of returning them to the
// kernel. Model chunks, frames and update payloads are megabytes each and are
// allocated every round; with glibc's defaults each one is a fresh mmap whose
// pages fault in on first touch, which profiling showed to cost more than the
// TLS encryption itself. Call once at the start of main().
#pragma once

#include <malloc.h>

#include <cstdint>
#include <fstream>
#include <optional>
#include <string>

namespace estuary {

inline void RetainFreedMemory() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's ceiling for this knob on 64-bit
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
  mallopt(M_ARENA_MAX, 1);  // thread arenas would return their free pages regardless
}

// This process's peak resident set so far (VmHWM of /proc/self/status), in
// bytes; nullopt where the kernel does not report it.
inline std::optional<uint64_t> PeakResidentBytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return uint64_t(std::stoull(line.substr(6))) * 1024;  // "VmHWM:  1234 kB"
  }
  return std::nullopt;
}

}  // namespace estuary
