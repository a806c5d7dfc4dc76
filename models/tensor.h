// Tensors and flat buffers.
//
// Every model keeps its parameters in one contiguous buffer per precision and
// its gradients in another of the same layout; a Manifest (base/manifest.h)
// names the views into it (name, shape, dtype, offset). Checkpoints, federated
// updates, DDP buckets and ZeRO shards are slices of that buffer, never
// per-tensor copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/device.h"
#include "base/manifest.h"
#include "base/status.h"

namespace estuary::models {

// A non-owning view of one tensor: where it lives, its shape, dtype and device.
struct TensorView {
  void* data = nullptr;
  std::vector<int64_t> shape;
  DType dtype = DType::kF32;
  Device device = Device::kCpu;

  int64_t numel() const;
  float* f32() const { return static_cast<float*>(data); }
};

}  // namespace estuary::models
