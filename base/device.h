// Where a buffer lives: host memory, or a CUDA GPU's. Models, communicators
// and the data-parallel engine all say it the same way.
#pragma once

#include <cstdint>

namespace estuary {

enum class Device : uint8_t { kCpu = 0, kCuda = 1 };

}  // namespace estuary
