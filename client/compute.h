// Where a site trains: the device and the precision, chosen by the site
// (--device cpu|cuda[:N], --precision fp32|bf16|fp16), never by the server —
// the federation's update is the same fp32 delta whichever is chosen.
#pragma once

#include <string>
#include <string_view>

#include "base/status.h"
#include "models/tensor.h"

namespace estuary::client {

struct Compute {
  Device device = Device::kCpu;
  int device_index = 0;
  DType precision = DType::kF32;
  std::string ToString() const;  // "cpu fp32", "cuda:0 bf16"
};

// Parses and checks that this build and machine can honour the choice: the
// CPU backend trains in fp32; cuda needs a build with nvcc and a usable
// device at that index. The error says which, e.g. "--device cuda:1: 1 CUDA
// device(s) visible".
Result<Compute> ParseCompute(std::string_view device, std::string_view precision);

}  // namespace estuary::client
