#include "proto/frame.h"

namespace estuary::proto {

std::string EncodeFrame(const Envelope& envelope) {
  const size_t size = envelope.ByteSizeLong();
  std::string frame(kFrameHeaderBytes + size, '\0');
  frame[0] = static_cast<char>((size >> 24) & 0xff);
  frame[1] = static_cast<char>((size >> 16) & 0xff);
  frame[2] = static_cast<char>((size >> 8) & 0xff);
  frame[3] = static_cast<char>(size & 0xff);
  envelope.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(frame.data() + kFrameHeaderBytes));
  return frame;
}

Result<uint32_t> ParseFrameHeader(const std::array<uint8_t, kFrameHeaderBytes>& header,
                                  uint64_t max_bytes) {
  const uint32_t size = (uint32_t{header[0]} << 24) | (uint32_t{header[1]} << 16) |
                        (uint32_t{header[2]} << 8) | uint32_t{header[3]};
  if (size == 0) return ProtocolError("frame: empty frame (length prefix 0)");
  if (size > max_bytes) {
    return ProtocolError("frame: length prefix {} exceeds the limit of {} bytes", size, max_bytes);
  }
  return size;
}

Result<Envelope> ParseEnvelope(const void* data, size_t size) {
  Envelope envelope;
  if (!envelope.ParseFromArray(data, static_cast<int>(size))) {
    return ProtocolError("frame: {} bytes are not a valid estuary.v1.Envelope", size);
  }
  if (envelope.body_case() == Envelope::BODY_NOT_SET) {
    return ProtocolError("frame: envelope carries no message (unknown type or empty)");
  }
  return envelope;
}

std::string_view BodyName(const Envelope& envelope) {
  switch (envelope.body_case()) {
    case Envelope::kHello: return "hello";
    case Envelope::kWelcome: return "welcome";
    case Envelope::kRoundStart: return "round_start";
    case Envelope::kModelChunk: return "model_chunk";
    case Envelope::kUpdateBegin: return "update_begin";
    case Envelope::kUpdateChunk: return "update_chunk";
    case Envelope::kUpdateCommit: return "update_commit";
    case Envelope::kUpdateAck: return "update_ack";
    case Envelope::kRoundClosed: return "round_closed";
    case Envelope::kHeartbeat: return "heartbeat";
    case Envelope::kError: return "error";
    case Envelope::BODY_NOT_SET: return "empty";
  }
  return "unknown";
}

}  // namespace estuary::proto
