#include "server/staging.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "proto/wire.h"

namespace estuary::server {

Result<std::unique_ptr<StagedUpdate>> StagedUpdate::Create(const Manifest& manifest,
                                                           uint64_t memory_budget,
                                                           const std::filesystem::path& spill_dir) {
  std::unique_ptr<StagedUpdate> staged(new StagedUpdate(manifest));
  staged->size_bytes_ = manifest.byte_size();
  if (staged->size_bytes_ <= memory_budget) {
    staged->memory_.reset(new float[staged->size_bytes_ / sizeof(float)]);
    return staged;
  }
  std::string pattern = (spill_dir / "estuary-upload-XXXXXX").string();
  int fd = mkstemp(pattern.data());
  if (fd < 0) return IoError("staging: {}: cannot create spill file: {}", pattern, std::strerror(errno));
  unlink(pattern.c_str());  // the file vanishes with the descriptor, whatever happens
  staged->fd_ = fd;
  if (ftruncate(fd, static_cast<off_t>(staged->size_bytes_)) != 0) {
    return IoError("staging: spill file in {}: cannot grow to {} bytes: {}", spill_dir.string(),
                   staged->size_bytes_, std::strerror(errno));
  }
  return staged;
}

StagedUpdate::~StagedUpdate() {
  if (mapped_) munmap(mapped_, size_bytes_);
  if (fd_ >= 0) close(fd_);
}

Status StagedUpdate::Append(uint64_t offset, v1::DType dtype, const std::string& bytes) {
  if (committed_) return ProtocolError("chunk: the update was already committed");
  ESTUARY_RETURN_IF_ERROR(proto::CheckChunk(manifest_, next_offset_, offset, bytes.size(), dtype));
  if (fd_ >= 0) {
    for (size_t done = 0; done < bytes.size();) {
      const ssize_t n = pwrite(fd_, bytes.data() + done, bytes.size() - done, off_t(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return IoError("staging: cannot write the spill file: {}", n < 0 ? std::strerror(errno) : "no progress");
      done += size_t(n);
    }
  } else {
    std::memcpy(reinterpret_cast<char*>(memory_.get()) + offset, bytes.data(), bytes.size());
  }
  hasher_.Update(bytes.data(), bytes.size());
  next_offset_ += bytes.size();
  return Status::Ok();
}

Status StagedUpdate::Commit(const std::string& sha256_hex) {
  if (committed_) return ProtocolError("commit: the update was already committed");
  if (next_offset_ != size_bytes_) {
    return ProtocolError("commit: {} of {} bytes received", next_offset_, size_bytes_);
  }
  const auto digest = hasher_.Final();
  const std::string actual = crypto::ToHex(digest);
  if (!crypto::SameHexDigest(actual, sha256_hex)) {
    return ProtocolError("commit: payload sha256 {} does not match the announced {}", actual, sha256_hex);
  }
  if (fd_ >= 0 && size_bytes_ > 0) {
    void* map = mmap(nullptr, size_bytes_, PROT_READ, MAP_SHARED, fd_, 0);
    if (map == MAP_FAILED) return IoError("staging: cannot map the spill file: {}", std::strerror(errno));
    mapped_ = map;
  }
  committed_ = true;
  return Status::Ok();
}

std::span<const float> StagedUpdate::values() const {
  const float* base = mapped_ ? static_cast<const float*>(mapped_) : memory_.get();
  return {base, size_bytes_ / sizeof(float)};
}

}  // namespace estuary::server
