// An upload as the server receives it: frames (a 4-byte length, then an
// envelope) carrying an UpdateBegin whose manifest passes proto::FromProto,
// then UpdateChunks appended to a server::StagedUpdate (proto::CheckChunk
// first) and an UpdateCommit. The staging budget is small, so larger uploads
// take the spill-file path. Whatever the frames, a chunk accepted lies inside
// the manifest's bytes, and a commit accepted has every byte present.
#include <array>
#include <cctype>
#include <cstring>
#include <memory>

#include "crypto/transfer_digest.h"
#include "fuzz/fuzz_util.h"
#include "fuzz/quiet_protobuf.h"
#include "proto/frame.h"
#include "proto/wire.h"
#include "server/staging.h"

namespace {

// What the harness's global model holds: uploads larger are refused at the manifest.
constexpr uint64_t kGlobalElements = uint64_t{1} << 16;
constexpr uint64_t kMemoryBudget = 1 << 10;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace estuary;
  std::unique_ptr<server::StagedUpdate> staged;
  Manifest manifest;
  bool committed = false;
  while (size >= proto::kFrameHeaderBytes) {
    std::array<uint8_t, proto::kFrameHeaderBytes> header;
    std::memcpy(header.data(), data, header.size());
    data += header.size();
    size -= header.size();
    auto length = proto::ParseFrameHeader(header, proto::kDefaultMaxFrameBytes);
    if (!length.ok() || *length > size) return 0;  // the connection is closed
    auto envelope = proto::ParseEnvelope(data, *length);
    data += *length;
    size -= *length;
    if (!envelope.ok()) return 0;

    if (envelope->has_update_begin()) {
      if (staged) return 0;  // one upload per round
      auto layout = proto::FromProto(envelope->update_begin().manifest(), kGlobalElements);
      if (!layout.ok()) {
        fuzz::CheckError(layout.status());
        return 0;
      }
      fuzz::CheckAcceptedManifest(*layout, kGlobalElements);
      manifest = *layout;
      auto created = server::StagedUpdate::Create(manifest, kMemoryBudget, fuzz::ScratchDir());
      FUZZ_CHECK(created.ok(), "%s", created.status().message().c_str());
      staged = std::move(created).value();
    } else if (envelope->has_update_chunk()) {
      if (!staged) return 0;
      const auto& chunk = envelope->update_chunk();
      const uint64_t before = staged->received_bytes();
      Status appended = staged->Append(chunk.offset(), chunk.dtype(), chunk.data());
      if (!appended.ok()) {
        fuzz::CheckError(appended);
        return 0;
      }
      FUZZ_CHECK(!committed && chunk.offset() == before && !chunk.data().empty());
      FUZZ_CHECK(staged->received_bytes() == before + chunk.data().size());
      FUZZ_CHECK(staged->received_bytes() <= manifest.byte_size());
    } else if (envelope->has_update_commit()) {
      if (!staged) return 0;
      Status commit = staged->Commit(envelope->update_commit().digest());
      if (!commit.ok()) {
        fuzz::CheckError(commit);
        continue;
      }
      FUZZ_CHECK(!committed && staged->received_bytes() == manifest.byte_size());
      const auto values = staged->values();
      FUZZ_CHECK(values.size_bytes() == manifest.byte_size());
      // The digest of exactly the bytes staged (in either case of hex digits).
      std::string announced = envelope->update_commit().digest();
      for (char& c : announced) c = char(std::tolower(static_cast<unsigned char>(c)));
      FUZZ_CHECK(crypto::TransferDigestHex(values.data(), values.size_bytes()) == announced);
      committed = true;
    } else {
      return 0;  // anything else during an upload is refused
    }
  }
  return 0;
}
