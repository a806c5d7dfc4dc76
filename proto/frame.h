// Length-prefixed frames: a 4-byte big-endian length, then one serialized
// estuary.v1.Envelope. The receiver checks the length against its limit
// before reading the body, so a hostile prefix cannot make it allocate.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "base/status.h"
#include "estuary.pb.h"

namespace estuary::proto {

using Envelope = ::estuary::v1::Envelope;

// 2: SecAgg+ masks come from AES-256-CTR (1 used ChaCha20); the two cannot cancel each other.
inline constexpr uint32_t kProtocolVersion = 2;
inline constexpr size_t kFrameHeaderBytes = 4;
inline constexpr uint64_t kDefaultMaxFrameBytes = 4u << 20;
inline constexpr uint32_t kDefaultChunkBytes = 1u << 20;
// A connection's frames before its Hello (the Hello included) may not exceed
// this: a Hello is a few dozen bytes, so a peer not yet a site cannot make
// the server hold a large buffer.
inline constexpr uint64_t kMaxHelloFrameBytes = 64u << 10;

// A frame ready to write: the length prefix, then the serialized envelope,
// in one buffer allocated without zero-filling (model-sized frames are filled
// once, right away).
class Frame {
 public:
  explicit Frame(size_t body_bytes);
  const uint8_t* data() const { return data_.get(); }
  size_t size() const { return size_; }
  uint8_t* body() { return data_.get() + kFrameHeaderBytes; }

 private:
  std::unique_ptr<uint8_t[]> data_;
  size_t size_;
};

Frame EncodeFrame(const Envelope& envelope);

// The frames of a ModelChunk and an UpdateChunk envelope, with the payload
// copied once, straight from `data` into the frame (a protobuf `bytes` field
// would copy it twice). Byte for byte what EncodeFrame gives for the same
// envelope.
Frame EncodeModelChunk(uint64_t round, uint64_t offset, const void* data, size_t size);
Frame EncodeUpdateChunk(uint64_t round, uint64_t offset, v1::DType dtype, const void* data, size_t size);

// A frame body being received: grows without zero-filling, and gives back
// a large buffer on Trim(), so thousands of idle connections do not each
// keep a model-sized one.
class BodyBuffer {
 public:
  uint8_t* Resize(size_t size);
  uint8_t* data() { return data_.get(); }
  size_t size() const { return size_; }
  void Trim();

 private:
  static constexpr size_t kKeepBytes = 64 << 10;
  std::unique_ptr<uint8_t[]> data_;
  size_t size_ = 0, capacity_ = 0;
};

// The body length announced by `header`; an error if it is zero or exceeds max_bytes.
Result<uint32_t> ParseFrameHeader(const std::array<uint8_t, kFrameHeaderBytes>& header,
                                  uint64_t max_bytes);

// Parses a frame body; an error if it is not an Envelope or carries no message.
Result<Envelope> ParseEnvelope(const void* data, size_t size);
// Protobuf writes its own line to stderr for every string field that is not
// UTF-8, before the parse fails: a peer could make the process write one per
// frame, beside the refusal ParseEnvelope returns (which the server counts
// and aggregates). Each program calls this once at start: protobuf's lines
// below FATAL are dropped.
void QuietProtobufLog();

// "round_start", "update_chunk", ... for logs and errors.
std::string_view BodyName(const Envelope& envelope);

}  // namespace estuary::proto
