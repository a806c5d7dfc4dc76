// Keeps freed large buffers in the process instead of returning them to the
// kernel. Model chunks, frames and update payloads are megabytes each and are
// allocated every round; with glibc's defaults each one is a fresh mmap whose
// pages fault in on first touch, which profiling showed to cost more than the
// TLS encryption itself. Call once at the start of main().
#pragma once

#include <malloc.h>

namespace estuary {

inline void RetainFreedMemory() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's ceiling for this knob on 64-bit
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
  mallopt(M_ARENA_MAX, 1);  // thread arenas would return their free pages regardless
}

}  // namespace estuary
