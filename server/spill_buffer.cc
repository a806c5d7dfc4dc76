#include "server/spill_buffer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace estuary::server {

Result<std::unique_ptr<SpillBuffer>> SpillBuffer::Create(uint64_t bytes, uint64_t memory_budget,
                                                         const std::filesystem::path& spill_dir,
                                                         std::string_view what) {
  std::unique_ptr<SpillBuffer> buffer(new SpillBuffer());
  buffer->what_ = std::string(what);
  buffer->size_ = bytes;
  if (bytes <= memory_budget) {
    // Uninitialised: pages become resident as they are written.
    buffer->memory_ = std::make_unique_for_overwrite<uint8_t[]>(bytes > 0 ? bytes : 1);
    return buffer;
  }
  std::string pattern = (spill_dir / "estuary-upload-XXXXXX").string();
  int fd = mkstemp(pattern.data());
  if (fd < 0) return IoError("{}: {}: cannot create spill file: {}", what, pattern, std::strerror(errno));
  unlink(pattern.c_str());  // the file vanishes with the descriptor, whatever happens
  buffer->fd_ = fd;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    return IoError("{}: spill file in {}: cannot grow to {} bytes: {}", what, spill_dir.string(), bytes,
                   std::strerror(errno));
  }
  return buffer;
}

SpillBuffer::~SpillBuffer() {
  if (mapped_) munmap(mapped_, size_);
  if (fd_ >= 0) close(fd_);
}

Status SpillBuffer::Write(uint64_t offset, const void* bytes, size_t n) {
  if (sealed_) return FailedPrecondition("{}: a write after the buffer was sealed", what_);
  if (offset > size_ || n > size_ - offset) {
    return InvalidArgument("{}: a write of {} bytes at {} is beyond the buffer's {}", what_, n, offset, size_);
  }
  if (fd_ < 0) {
    std::memcpy(memory_.get() + offset, bytes, n);
    return Status::Ok();
  }
  const auto* from = static_cast<const uint8_t*>(bytes);
  for (size_t done = 0; done < n;) {
    const ssize_t wrote = pwrite(fd_, from + done, n - done, off_t(offset + done));
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) {
      return IoError("{}: cannot write the spill file: {}", what_, wrote < 0 ? std::strerror(errno) : "no progress");
    }
    done += size_t(wrote);
  }
  return Status::Ok();
}

Status SpillBuffer::Read(uint64_t offset, void* out, size_t n) const {
  if (offset > size_ || n > size_ - offset) {
    return InvalidArgument("{}: a read of {} bytes at {} is beyond the buffer's {}", what_, n, offset, size_);
  }
  if (fd_ < 0) {
    std::memcpy(out, memory_.get() + offset, n);
    return Status::Ok();
  }
  auto* to = static_cast<uint8_t*>(out);
  for (size_t done = 0; done < n;) {
    const ssize_t got = pread(fd_, to + done, n - done, off_t(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      return IoError("{}: cannot read the spill file: {}", what_, got < 0 ? std::strerror(errno) : "end of file");
    }
    done += size_t(got);
  }
  return Status::Ok();
}

Status SpillBuffer::Seal() {
  if (sealed_) return Status::Ok();
  if (fd_ >= 0 && size_ > 0) {
    void* map = mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0);
    if (map == MAP_FAILED) return IoError("{}: cannot map the spill file: {}", what_, std::strerror(errno));
    mapped_ = map;
    base_ = static_cast<const uint8_t*>(map);
  } else {
    base_ = memory_.get();
  }
  sealed_ = true;
  return Status::Ok();
}

}  // namespace estuary::server
