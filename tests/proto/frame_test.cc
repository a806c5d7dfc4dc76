#include <gtest/gtest.h>

#include "proto/frame.h"
#include "proto/wire.h"

namespace estuary::proto {
namespace {

std::array<uint8_t, 4> Header(const Frame& frame) {
  return {frame.data()[0], frame.data()[1], frame.data()[2], frame.data()[3]};
}

std::string Bytes(const Frame& frame) { return {reinterpret_cast<const char*>(frame.data()), frame.size()}; }

TEST(Frame, RoundTripsAnEnvelope) {
  Envelope envelope;
  envelope.mutable_update_chunk()->set_round(3);
  envelope.mutable_update_chunk()->set_offset(4096);
  envelope.mutable_update_chunk()->set_data(std::string(1000, 'x'));
  const Frame frame = EncodeFrame(envelope);
  auto size = ParseFrameHeader(Header(frame), 1 << 20);
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size + kFrameHeaderBytes, frame.size());
  auto parsed = ParseEnvelope(frame.data() + 4, *size);
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(parsed->update_chunk().offset(), 4096u);
  EXPECT_EQ(parsed->update_chunk().data().size(), 1000u);
  EXPECT_EQ(BodyName(*parsed), "update_chunk");
}

// The chunk encoders skip a copy of the payload; the bytes must be exactly
// what protobuf writes for the same envelope, including proto3's omission of
// zero-valued fields (round 0, offset 0, dtype f32) and of empty data.
TEST(Frame, ChunkEncodersWriteProtobufsOwnBytes) {
  std::string payload(3 << 20, '\0');
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = char(i * 131 + 7);
  for (uint64_t round : {uint64_t{0}, uint64_t{1}, uint64_t{1} << 40}) {
    for (uint64_t offset : {uint64_t{0}, uint64_t{4096}, uint64_t{1} << 33}) {
      for (size_t size : {size_t{0}, size_t{4}, size_t{127}, size_t{128}, size_t{1} << 20, payload.size()}) {
        Envelope model;
        model.mutable_model_chunk()->set_round(round);
        model.mutable_model_chunk()->set_offset(offset);
        model.mutable_model_chunk()->set_data(payload.substr(0, size));
        EXPECT_EQ(Bytes(EncodeModelChunk(round, offset, payload.data(), size)), Bytes(EncodeFrame(model)))
            << "round " << round << " offset " << offset << " size " << size;
        for (v1::DType dtype : {v1::DTYPE_F32, v1::DTYPE_BF16}) {
          Envelope update;
          update.mutable_update_chunk()->set_round(round);
          update.mutable_update_chunk()->set_offset(offset);
          update.mutable_update_chunk()->set_dtype(dtype);
          update.mutable_update_chunk()->set_data(payload.substr(0, size));
          EXPECT_EQ(Bytes(EncodeUpdateChunk(round, offset, dtype, payload.data(), size)), Bytes(EncodeFrame(update)))
              << "round " << round << " offset " << offset << " size " << size << " dtype " << dtype;
        }
      }
    }
  }
}

TEST(Frame, BodyBufferKeepsSmallBuffersAndGivesBackLargeOnes) {
  BodyBuffer buffer;
  uint8_t* small = buffer.Resize(100);
  buffer.Trim();
  EXPECT_EQ(buffer.Resize(50), small) << "a small buffer is reused, not reallocated";
  EXPECT_EQ(buffer.size(), 50u);
  buffer.Resize(1 << 20);
  buffer.Trim();
  EXPECT_EQ(buffer.data(), nullptr) << "a model-sized buffer goes back to the allocator";
  EXPECT_EQ(buffer.size(), 0u);
}

TEST(Frame, RefusesALengthOverTheLimitBeforeReadingTheBody) {
  auto size = ParseFrameHeader({0x01, 0x00, 0x00, 0x01}, 1 << 24);
  ASSERT_FALSE(size.ok());
  EXPECT_NE(size.status().message().find("16777217 exceeds the limit of 16777216"), std::string::npos)
      << size.status().message();
  EXPECT_FALSE(ParseFrameHeader({0, 0, 0, 0}, 100).ok());
  EXPECT_TRUE(ParseFrameHeader({0, 0, 0, 100}, 100).ok());
}

TEST(Frame, RefusesGarbageAndEmptyEnvelopes) {
  const std::string garbage = "\xff\xff\xff\xff\xff\xff\xff";
  EXPECT_FALSE(ParseEnvelope(garbage.data(), garbage.size()).ok());
  Envelope empty;
  const std::string bytes = empty.SerializeAsString() + std::string("\x08\x01", 2);  // unknown field 1 varint
  auto parsed = ParseEnvelope(bytes.data(), bytes.size());
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("no message"), std::string::npos);
}

Manifest TwoTensors() {
  Manifest m;
  m.tensors.push_back({"a", {4, 2}, DType::kF32, 0});
  m.tensors.push_back({"b", {3}, DType::kF32, 8});
  m.total_elements = 11;
  return m;
}

TEST(Wire, ManifestRoundTripsAndIsValidated) {
  const auto manifest = TwoTensors();
  auto back = FromProto(ToProto(manifest), 1000);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(*back == manifest);
  EXPECT_FALSE(FromProto(ToProto(manifest), 10).ok());  // over the element limit
  auto overlapping = ToProto(manifest);
  overlapping.mutable_tensors(1)->set_offset(7);
  EXPECT_FALSE(FromProto(overlapping, 1000).ok());
  auto negative = ToProto(manifest);
  negative.mutable_tensors(0)->set_shape(0, -4);
  EXPECT_FALSE(FromProto(negative, 1000).ok());
}

TEST(Wire, RefusesAManifestWhoseElementCountsOverflow) {
  // Each dimension is within a site's limit of 2^34 elements, but 2^32 x 2^32
  // wraps to 0 in 64 bits: once a tensor of no elements with that shape.
  v1::Manifest wire;
  auto* t = wire.add_tensors();
  t->set_name("w");
  t->add_shape(int64_t{1} << 32);
  t->add_shape(int64_t{1} << 32);
  auto wrapped = FromProto(wire, uint64_t{1} << 34);
  ASSERT_FALSE(wrapped.ok());
  EXPECT_NE(wrapped.status().message().find("tensor 'w' has more than"), std::string::npos)
      << wrapped.status().message();
  // Two tensors whose ends wrap.
  Manifest m;
  m.tensors.push_back({"a", {int64_t{1} << 62}, DType::kF32, 0});
  m.tensors.push_back({"b", {int64_t{1} << 62}, DType::kF32, uint64_t{1} << 62});
  EXPECT_FALSE(m.Validate().ok());
}

TEST(Wire, AnErrorIsOneLineWhateverThePeerSent) {
  // A peer's tensor name with line breaks must not split the error, or the server's log line.
  auto wire = ToProto(TwoTensors());
  wire.mutable_tensors(0)->set_name("evil\n[error] forged line\r\x1b[2J");
  wire.mutable_tensors(0)->set_shape(0, 0);
  auto refused = FromProto(wire, 1000);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().message(),
            "wire: tensor 'evil\\n[error] forged line\\r\\x1b[2J' has bad dimension 0");
  EXPECT_EQ(Status(Code::kInternal, "tab\tstays").message(), "tab\tstays");
}

TEST(Wire, ChunksMustContinueTheBufferInOrderWithTheRightDtype) {
  const auto m = TwoTensors();  // 44 bytes
  EXPECT_TRUE(CheckChunk(m, 0, 0, 16, v1::DTYPE_F32).ok());
  EXPECT_TRUE(CheckChunk(m, 16, 16, 28, v1::DTYPE_F32).ok());
  EXPECT_FALSE(CheckChunk(m, 16, 20, 8, v1::DTYPE_F32).ok());   // gap
  EXPECT_FALSE(CheckChunk(m, 16, 12, 8, v1::DTYPE_F32).ok());   // overlap
  EXPECT_FALSE(CheckChunk(m, 40, 40, 8, v1::DTYPE_F32).ok());   // past the end
  EXPECT_FALSE(CheckChunk(m, 0, 0, 6, v1::DTYPE_F32).ok());     // not whole elements
  EXPECT_FALSE(CheckChunk(m, 0, 0, 0, v1::DTYPE_F32).ok());     // empty
  auto wrong = CheckChunk(m, 0, 0, 8, v1::DTYPE_BF16);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.message().find("DTYPE_BF16"), std::string::npos);
}

// A string that is not UTF-8 is refused by the parse alone: protobuf's own
// line on stderr, one per frame a peer sends, is dropped.
TEST(Frame, AStringThatIsNotUtf8IsRefusedWithoutProtobufsOwnLine) {
  Envelope envelope;
  envelope.mutable_error()->set_message("caf\xe9");
  std::string bytes;
  ::testing::internal::CaptureStderr();
  ASSERT_TRUE(envelope.SerializeToString(&bytes));  // protobuf complains here too
  const std::string unquieted = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(unquieted.find("UTF-8"), std::string::npos) << "protobuf logs it unless told not to: " << unquieted;

  QuietProtobufLog();
  ::testing::internal::CaptureStderr();
  auto parsed = ParseEnvelope(bytes.data(), bytes.size());
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("are not a valid estuary.v1.Envelope"), std::string::npos);
}

}  // namespace
}  // namespace estuary::proto
