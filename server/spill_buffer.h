// SpillBuffer: a fixed number of bytes held in memory when they fit a budget,
// and beyond it in an unlinked temporary file — where a staged upload
// (server/staging.h) and a secure-aggregation input's undo copy
// (server/secagg_state.h) live. Bytes go in with Write and come back with
// Read; Seal makes the whole buffer one read-only span. A spilled buffer is
// written with pwrite, never through a writable mapping, so a disk that
// refuses a write (full, quota) is that Write's error rather than a SIGBUS.
// Memory is not touched up front, so only what is written becomes resident;
// the file vanishes with the buffer, whatever happens.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>

#include "base/status.h"

namespace estuary::server {

class SpillBuffer {
 public:
  // `bytes` in memory if at most `memory_budget`, else in a file under
  // `spill_dir`. Fails, naming `what` and the directory, when the file cannot
  // be made.
  static Result<std::unique_ptr<SpillBuffer>> Create(uint64_t bytes, uint64_t memory_budget,
                                                     const std::filesystem::path& spill_dir, std::string_view what);
  ~SpillBuffer();
  SpillBuffer(const SpillBuffer&) = delete;
  SpillBuffer& operator=(const SpillBuffer&) = delete;

  // [offset, offset + n) must lie within size(); not after Seal.
  Status Write(uint64_t offset, const void* bytes, size_t n);
  Status Read(uint64_t offset, void* out, size_t n) const;
  // The whole buffer as one span from now on (a spilled one is mapped read-only).
  Status Seal();
  // Valid after Seal.
  std::span<const uint8_t> sealed() const { return {base_, size_}; }

  uint64_t size() const { return size_; }
  bool spilled() const { return fd_ >= 0; }

 private:
  SpillBuffer() = default;

  std::string what_;
  uint64_t size_ = 0;
  std::unique_ptr<uint8_t[]> memory_;
  void* mapped_ = nullptr;  // a spilled buffer, after Seal
  int fd_ = -1;
  const uint8_t* base_ = nullptr;  // after Seal
  bool sealed_ = false;
};

}  // namespace estuary::server
