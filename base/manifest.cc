#include "base/manifest.h"

#include <set>

namespace estuary {

size_t DTypeSize(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
  }
  return "?";
}

Result<DType> ParseDType(std::string_view name) {
  if (name == "f32") return DType::kF32;
  if (name == "bf16") return DType::kBF16;
  if (name == "f16") return DType::kF16;
  return InvalidArgument("unknown dtype '{}' (expected f32, bf16 or f16)", name);
}

uint64_t TensorSpec::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

uint64_t Manifest::Append(std::string name, std::vector<int64_t> shape) {
  TensorSpec spec{std::move(name), std::move(shape), DType::kF32, total_elements};
  total_elements += spec.numel();
  tensors.push_back(std::move(spec));
  return tensors.back().offset;
}

uint64_t Manifest::byte_size() const {
  uint64_t bytes = 0;
  for (const auto& t : tensors) bytes += t.numel() * DTypeSize(t.dtype);
  return bytes;
}

const TensorSpec* Manifest::Find(std::string_view name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

Status Manifest::Validate() const {
  std::set<std::string_view> names;
  uint64_t next = 0;
  for (const auto& t : tensors) {
    if (t.name.empty()) return InvalidArgument("manifest: a tensor has an empty name");
    if (!names.insert(t.name).second) return InvalidArgument("manifest: tensor '{}' appears twice", t.name);
    if (t.shape.empty()) return InvalidArgument("manifest: tensor '{}' has no shape", t.name);
    // The element count, and where the tensor ends, computed without
    // overflow: a shape whose product wraps around 2^64 would otherwise pass
    // as a tensor of a few elements (or none).
    uint64_t n = 1;
    for (int64_t d : t.shape) {
      if (d <= 0) return InvalidArgument("manifest: tensor '{}' has dimension {}", t.name, d);
      if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n) || n > kMaxElements) {
        return InvalidArgument("manifest: tensor '{}' has more than {} elements", t.name, kMaxElements);
      }
    }
    if (t.offset != next) {
      return InvalidArgument("manifest: tensor '{}' starts at {} but the previous one ends at {}", t.name, t.offset,
                             next);
    }
    if (n > kMaxElements - next) {
      return InvalidArgument("manifest: tensor '{}' ends past {} elements", t.name, kMaxElements);
    }
    next += n;
  }
  if (next != total_elements) {
    return InvalidArgument("manifest: tensors cover {} elements but total_elements is {}", next, total_elements);
  }
  return Status::Ok();
}

bool Manifest::operator==(const Manifest& other) const {
  if (total_elements != other.total_elements || tensors.size() != other.tensors.size()) return false;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& a = tensors[i];
    const auto& b = other.tensors[i];
    if (a.name != b.name || a.shape != b.shape || a.dtype != b.dtype || a.offset != b.offset) return false;
  }
  return true;
}

}  // namespace estuary
