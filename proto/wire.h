// Conversions between wire messages and flat-buffer layouts (base/manifest.h), and the checks every
// received manifest and chunk must pass before its bytes are used.
#pragma once

#include <cstdint>

#include "base/status.h"
#include "estuary.pb.h"
#include "base/manifest.h"

namespace estuary::proto {

v1::Manifest ToProto(const Manifest& manifest);
// Converts and validates (shapes, offsets, tiling, dtypes, a size limit).
Result<Manifest> FromProto(const v1::Manifest& manifest, uint64_t max_elements);

v1::DType ToProto(DType dtype);
Result<DType> FromProto(v1::DType dtype);

// Checks one chunk of a flat buffer laid out by `manifest` (f32 throughout):
// it starts exactly at `expected_offset` (chunks arrive in order, no gaps or
// overlaps), is non-empty, a whole number of elements, within the buffer, and
// its dtype matches the tensors it covers. Offsets and sizes are in bytes.
Status CheckChunk(const Manifest& manifest, uint64_t expected_offset, uint64_t offset,
                  uint64_t size, v1::DType dtype);

}  // namespace estuary::proto
