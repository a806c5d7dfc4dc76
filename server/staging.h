// StagedUpdate: where one client's upload accumulates until it is committed.
//
// Chunks must arrive in order and agree with the manifest (proto::CheckChunk).
// The payload lives in memory when it fits the per-upload memory budget and
// in an unlinked temporary file beyond it (server/spill_buffer.h: written with
// pwrite, so a full disk is that chunk's error, and mapped read-only once
// committed); either way the fold reads it as one span. The SHA-256 is computed while chunks arrive, so
// Commit() only compares. Destroying an uncommitted StagedUpdate discards it:
// nothing of a partial upload ever reaches an aggregate.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "crypto/transfer_digest.h"
#include "estuary.pb.h"
#include "models/tensor.h"
#include "server/spill_buffer.h"

namespace estuary::server {

class StagedUpdate {
 public:
  // Reserves room for manifest.byte_size() bytes, in memory if that is at most
  // memory_budget, else in a temporary file under spill_dir.
  static Result<std::unique_ptr<StagedUpdate>> Create(const Manifest& manifest,
                                                      uint64_t memory_budget,
                                                      const std::filesystem::path& spill_dir);
  ~StagedUpdate();

  Status Append(uint64_t offset, v1::DType dtype, const std::string& bytes);
  // Every byte present and their SHA-256 equal to `sha256_hex`.
  Status Commit(const std::string& sha256_hex);

  uint64_t received_bytes() const { return next_offset_; }
  uint64_t size_bytes() const { return size_bytes_; }  // the whole upload's
  bool spilled() const { return buffer_->spilled(); }
  // Valid after a successful Commit().
  std::span<const float> values() const;

 private:
  explicit StagedUpdate(Manifest manifest) : manifest_(std::move(manifest)) {}

  Manifest manifest_;
  uint64_t size_bytes_ = 0;
  uint64_t next_offset_ = 0;
  bool committed_ = false;
  crypto::TransferDigest digest_;
  std::unique_ptr<SpillBuffer> buffer_;
};

}  // namespace estuary::server
