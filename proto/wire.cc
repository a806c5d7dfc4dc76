#include "proto/wire.h"

namespace estuary::proto {

v1::DType ToProto(DType dtype) {
  switch (dtype) {
    case DType::kF32: return v1::DTYPE_F32;
    case DType::kBF16: return v1::DTYPE_BF16;
    case DType::kF16: return v1::DTYPE_F16;
  }
  return v1::DTYPE_F32;
}

Result<DType> FromProto(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32: return DType::kF32;
    case v1::DTYPE_BF16: return DType::kBF16;
    case v1::DTYPE_F16: return DType::kF16;
    default: return ProtocolError("wire: unknown dtype {}", static_cast<int>(dtype));
  }
}

v1::Manifest ToProto(const Manifest& manifest) {
  v1::Manifest out;
  out.set_total_elements(manifest.total_elements);
  for (const auto& spec : manifest.tensors) {
    auto* t = out.add_tensors();
    t->set_name(spec.name);
    for (int64_t d : spec.shape) t->add_shape(d);
    t->set_dtype(ToProto(spec.dtype));
    t->set_offset(spec.offset);
  }
  return out;
}

Result<Manifest> FromProto(const v1::Manifest& manifest, uint64_t max_elements) {
  if (manifest.total_elements() > max_elements) {
    return ProtocolError("wire: manifest of {} elements exceeds the limit of {}",
                         manifest.total_elements(), max_elements);
  }
  Manifest out;
  out.total_elements = manifest.total_elements();
  for (const auto& t : manifest.tensors()) {
    TensorSpec spec;
    spec.name = t.name();
    for (int64_t d : t.shape()) {
      if (d <= 0 || static_cast<uint64_t>(d) > max_elements) {
        return ProtocolError("wire: tensor '{}' has bad dimension {}", t.name(), d);
      }
      spec.shape.push_back(d);
    }
    ESTUARY_ASSIGN_OR_RETURN(spec.dtype, FromProto(t.dtype()));
    spec.offset = t.offset();
    out.tensors.push_back(std::move(spec));
  }
  Status valid = out.Validate();
  if (!valid.ok()) return ProtocolError("wire: bad manifest: {}", valid.message());
  return out;
}

Status CheckChunk(const Manifest& manifest, uint64_t expected_offset, uint64_t offset,
                  uint64_t size, v1::DType dtype) {
  const uint64_t total = manifest.byte_size();
  if (offset != expected_offset) {
    return ProtocolError("chunk: offset {} but the next expected byte is {}", offset, expected_offset);
  }
  if (size == 0) return ProtocolError("chunk: empty chunk at offset {}", offset);
  if (offset > total || size > total - offset) {
    return ProtocolError("chunk: bytes [{}, {}) run past the buffer's {} bytes", offset, offset + size, total);
  }
  if (dtype != v1::DTYPE_F32) {
    return ProtocolError("chunk: dtype {} at offset {} but the manifest holds f32 there",
                         v1::DType_Name(dtype), offset);
  }
  if (offset % sizeof(float) != 0 || size % sizeof(float) != 0) {
    return ProtocolError("chunk: bytes [{}, {}) are not whole f32 elements", offset, offset + size);
  }
  return Status::Ok();
}

}  // namespace estuary::proto
