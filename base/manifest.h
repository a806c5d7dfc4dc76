// The layout of a flat buffer: named tensors (shape, dtype, offset) that tile
// it. Models keep their parameters in one such buffer and their gradients in
// another of the same layout; checkpoints, federated updates, DDP buckets and
// ZeRO shards are slices of it, and the wire describes every model and update
// it streams by one. Offsets and sizes count elements, not bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace estuary {

enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

size_t DTypeSize(DType dtype);
std::string_view DTypeName(DType dtype);  // "f32", "bf16", "f16"
Result<DType> ParseDType(std::string_view name);

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kF32;
  uint64_t offset = 0;  // first element inside the flat buffer
  uint64_t numel() const;
};

// Tensors are sorted by offset, do not overlap and tile [0, total_elements)
// exactly; Validate() checks all of that, and that no element count, offset
// or byte size can overflow (at most kMaxElements elements in all).
struct Manifest {
  static constexpr uint64_t kMaxElements = uint64_t{1} << 60;

  std::vector<TensorSpec> tensors;
  uint64_t total_elements = 0;

  // Appends an fp32 tensor after the last one; returns its offset. How the
  // models lay out their flat buffers, one tensor at a time.
  uint64_t Append(std::string name, std::vector<int64_t> shape);

  uint64_t byte_size() const;  // sum over tensors of numel * dtype size
  const TensorSpec* Find(std::string_view name) const;
  Status Validate() const;
  bool operator==(const Manifest& other) const;
};

}  // namespace estuary
