// Length-prefixed frames: a 4-byte big-endian length, then one serialized
// estuary.v1.Envelope. The receiver checks the length against its limit
// before reading the body, so a hostile prefix cannot make it allocate.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "base/status.h"
#include "estuary.pb.h"

namespace estuary::proto {

using Envelope = ::estuary::v1::Envelope;

inline constexpr uint32_t kProtocolVersion = 1;
inline constexpr size_t kFrameHeaderBytes = 4;
inline constexpr uint64_t kDefaultMaxFrameBytes = 4u << 20;
inline constexpr uint32_t kDefaultChunkBytes = 1u << 20;

// Header followed by the serialized envelope, ready to write.
std::string EncodeFrame(const Envelope& envelope);

// The body length announced by `header`; an error if it is zero or exceeds max_bytes.
Result<uint32_t> ParseFrameHeader(const std::array<uint8_t, kFrameHeaderBytes>& header,
                                  uint64_t max_bytes);

// Parses a frame body; an error if it is not an Envelope or carries no message.
Result<Envelope> ParseEnvelope(const void* data, size_t size);

// "round_start", "update_chunk", ... for logs and errors.
std::string_view BodyName(const Envelope& envelope);

}  // namespace estuary::proto
