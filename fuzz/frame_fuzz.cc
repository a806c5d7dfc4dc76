// One frame as it arrives from a peer: the 4-byte length prefix
// (proto::ParseFrameHeader, under the limits the server and the client use)
// and the body (proto::ParseEnvelope). An envelope that parses must encode
// back to a frame that parses to the same message, and the chunk encoders
// must write exactly the bytes EncodeFrame writes for the same chunk.
#include <array>
#include <cstring>
#include <string>

#include "fuzz/fuzz_util.h"
#include "fuzz/quiet_protobuf.h"
#include "proto/frame.h"

namespace estuary::proto {
namespace {

std::string Bytes(const Frame& frame) { return {reinterpret_cast<const char*>(frame.data()), frame.size()}; }

uint32_t LengthOf(const Frame& frame) {
  std::array<uint8_t, kFrameHeaderBytes> header;
  std::memcpy(header.data(), frame.data(), header.size());
  auto length = ParseFrameHeader(header, uint64_t{1} << 32);
  FUZZ_CHECK(length.ok(), "%s", length.status().message().c_str());
  return *length;
}

}  // namespace
}  // namespace estuary::proto

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace estuary::proto;
  if (size < kFrameHeaderBytes) return 0;
  std::array<uint8_t, kFrameHeaderBytes> header;
  std::memcpy(header.data(), data, header.size());
  for (uint64_t limit : {uint64_t{64} << 10, kDefaultMaxFrameBytes}) {
    auto length = ParseFrameHeader(header, limit);
    if (length.ok()) FUZZ_CHECK(*length > 0 && *length <= limit);
    else estuary::fuzz::CheckError(length.status());
  }

  const uint8_t* body = data + kFrameHeaderBytes;
  const size_t body_size = size - kFrameHeaderBytes;
  auto envelope = ParseEnvelope(body, body_size);
  if (!envelope.ok()) {
    estuary::fuzz::CheckError(envelope.status());
    return 0;
  }
  FUZZ_CHECK(envelope->body_case() != Envelope::BODY_NOT_SET);
  FUZZ_CHECK(BodyName(*envelope) != "unknown" && BodyName(*envelope) != "empty");

  const Frame frame = EncodeFrame(*envelope);
  FUZZ_CHECK(LengthOf(frame) + kFrameHeaderBytes == frame.size());
  auto again = ParseEnvelope(frame.data() + kFrameHeaderBytes, frame.size() - kFrameHeaderBytes);
  FUZZ_CHECK(again.ok(), "%s", again.status().message().c_str());
  FUZZ_CHECK(again->SerializeAsString() == envelope->SerializeAsString());

  if (envelope->has_model_chunk()) {
    const auto& chunk = envelope->model_chunk();
    Envelope plain;
    *plain.mutable_model_chunk() = chunk;
    plain.mutable_model_chunk()->DiscardUnknownFields();
    FUZZ_CHECK(Bytes(EncodeModelChunk(chunk.round(), chunk.offset(), chunk.data().data(), chunk.data().size())) ==
               Bytes(EncodeFrame(plain)));
  }
  if (envelope->has_update_chunk()) {
    const auto& chunk = envelope->update_chunk();
    Envelope plain;
    *plain.mutable_update_chunk() = chunk;
    plain.mutable_update_chunk()->DiscardUnknownFields();
    FUZZ_CHECK(Bytes(EncodeUpdateChunk(chunk.round(), chunk.offset(), chunk.dtype(), chunk.data().data(),
                                       chunk.data().size())) == Bytes(EncodeFrame(plain)));
  }
  return 0;
}
