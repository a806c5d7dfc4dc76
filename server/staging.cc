#include "server/staging.h"

#include <cstring>

#include "crypto/sha256.h"
#include "proto/wire.h"

namespace estuary::server {

Result<std::unique_ptr<StagedUpdate>> StagedUpdate::Create(const Manifest& manifest,
                                                           uint64_t memory_budget,
                                                           const std::filesystem::path& spill_dir) {
  std::unique_ptr<StagedUpdate> staged(new StagedUpdate(manifest));
  staged->size_bytes_ = manifest.byte_size();
  ESTUARY_ASSIGN_OR_RETURN(staged->buffer_,
                           SpillBuffer::Create(staged->size_bytes_, memory_budget, spill_dir, "staging"));
  return staged;
}

StagedUpdate::~StagedUpdate() = default;

Status StagedUpdate::Append(uint64_t offset, v1::DType dtype, const std::string& bytes) {
  if (committed_) return ProtocolError("chunk: the update was already committed");
  ESTUARY_RETURN_IF_ERROR(proto::CheckChunk(manifest_, next_offset_, offset, bytes.size(), dtype));
  ESTUARY_RETURN_IF_ERROR(buffer_->Write(offset, bytes.data(), bytes.size()));
  digest_.Update(bytes.data(), bytes.size());
  next_offset_ += bytes.size();
  return Status::Ok();
}

Status StagedUpdate::Commit(const std::string& digest_hex) {
  if (committed_) return ProtocolError("commit: the update was already committed");
  if (next_offset_ != size_bytes_) {
    return ProtocolError("commit: {} of {} bytes received", next_offset_, size_bytes_);
  }
  const std::string actual = digest_.FinalHex();
  if (!crypto::SameHexDigest(actual, digest_hex)) {
    return ProtocolError("commit: payload digest {} does not match the announced {}", actual, digest_hex);
  }
  ESTUARY_RETURN_IF_ERROR(buffer_->Seal());
  committed_ = true;
  return Status::Ok();
}

std::span<const float> StagedUpdate::values() const {
  return {reinterpret_cast<const float*>(buffer_->sealed().data()), size_bytes_ / sizeof(float)};
}

}  // namespace estuary::server
