#include "proto/frame.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/stubs/logging.h>
#include <google/protobuf/wire_format_lite.h>

#include <cstdio>
#include <cstring>

namespace estuary::proto {

namespace {

using google::protobuf::io::CodedOutputStream;
using google::protobuf::internal::WireFormatLite;

uint8_t* WriteHeader(uint8_t* frame, size_t body_bytes) {
  frame[0] = uint8_t(body_bytes >> 24);
  frame[1] = uint8_t(body_bytes >> 16);
  frame[2] = uint8_t(body_bytes >> 8);
  frame[3] = uint8_t(body_bytes);
  return frame + kFrameHeaderBytes;
}

uint8_t* WriteLengthDelimitedTag(int field, size_t length, uint8_t* out) {
  out = CodedOutputStream::WriteTagToArray(
      WireFormatLite::MakeTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED), out);
  return CodedOutputStream::WriteVarint64ToArray(length, out);
}

size_t LengthDelimitedSize(int field, size_t length) {
  return CodedOutputStream::VarintSize32(
             WireFormatLite::MakeTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) +
         CodedOutputStream::VarintSize64(length) + length;
}

// Envelope { body_field: Chunk { <fields of `head`>, data_field: data } }.
// Protobuf writes fields in number order and `data` is the chunk's last
// field, so serialising the rest first and appending data is canonical.
template <typename Chunk>
Frame EncodeChunk(int body_field, const Chunk& head, int data_field, const void* data, size_t size) {
  const size_t head_bytes = head.ByteSizeLong();
  // proto3 leaves an empty bytes field out.
  const size_t chunk_bytes = head_bytes + (size > 0 ? LengthDelimitedSize(data_field, size) : 0);
  Frame frame(LengthDelimitedSize(body_field, chunk_bytes));
  uint8_t* out = WriteLengthDelimitedTag(body_field, chunk_bytes, frame.body());
  out = head.SerializeWithCachedSizesToArray(out);
  if (size > 0) std::memcpy(WriteLengthDelimitedTag(data_field, size, out), data, size);
  return frame;
}

}  // namespace

Frame::Frame(size_t body_bytes)
    : data_(new uint8_t[kFrameHeaderBytes + body_bytes]), size_(kFrameHeaderBytes + body_bytes) {
  WriteHeader(data_.get(), body_bytes);
}

Frame EncodeFrame(const Envelope& envelope) {
  Frame frame(envelope.ByteSizeLong());
  envelope.SerializeWithCachedSizesToArray(frame.body());
  return frame;
}

Frame EncodeModelChunk(uint64_t round, uint64_t offset, const void* data, size_t size) {
  v1::ModelChunk head;
  head.set_round(round);
  head.set_offset(offset);
  return EncodeChunk(Envelope::kModelChunkFieldNumber, head, v1::ModelChunk::kDataFieldNumber, data, size);
}

Frame EncodeUpdateChunk(uint64_t round, uint64_t offset, v1::DType dtype, const void* data, size_t size) {
  v1::UpdateChunk head;
  head.set_round(round);
  head.set_offset(offset);
  head.set_dtype(dtype);
  return EncodeChunk(Envelope::kUpdateChunkFieldNumber, head, v1::UpdateChunk::kDataFieldNumber, data, size);
}

uint8_t* BodyBuffer::Resize(size_t size) {
  if (size > capacity_) {
    data_.reset(new uint8_t[size]);
    capacity_ = size;
  }
  size_ = size;
  return data_.get();
}

void BodyBuffer::Trim() {
  if (capacity_ <= kKeepBytes) return;
  data_.reset();
  size_ = capacity_ = 0;
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

void QuietProtobufLog() {
  google::protobuf::SetLogHandler([](google::protobuf::LogLevel level, const char* file, int line,
                                     const std::string& message) {
    if (level == google::protobuf::LOGLEVEL_FATAL) std::fprintf(stderr, "protobuf: %s:%d: %s\n", file, line, message.c_str());
  });
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
    case Envelope::kRefusal: return "refusal";
    case Envelope::kSecaggAdvertise: return "secagg_advertise";
    case Envelope::kSecaggKeys: return "secagg_keys";
    case Envelope::kSecaggShares: return "secagg_shares";
    case Envelope::kSecaggInbox: return "secagg_inbox";
    case Envelope::kSecaggMaskedChunk: return "secagg_masked_chunk";
    case Envelope::kSecaggMaskedDone: return "secagg_masked_done";
    case Envelope::kSecaggUnmask: return "secagg_unmask";
    case Envelope::kSecaggUnmaskResponse: return "secagg_unmask_response";
    case Envelope::kSecaggSurvivors: return "secagg_survivors";
    case Envelope::kSecaggSurvivorsSigned: return "secagg_survivors_signed";
    case Envelope::kEvalReport: return "eval_report";
    case Envelope::BODY_NOT_SET: return "empty";
  }
  return "unknown";
}

}  // namespace estuary::proto
