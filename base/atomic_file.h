// WriteFileAtomically: a file replaced whole or not at all.
#pragma once

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>

#include "base/status.h"

namespace estuary {

// Writes `bytes` to `path` (mode 0644) so that a reader, or a crash, sees the
// old file or the new one and never a part of either: a uniquely named
// temporary in the same directory, fsync, rename over `path`, fsync of the
// directory. On failure nothing is left behind; errors name the path.
inline Status WriteFileAtomically(const std::filesystem::path& path, std::string_view bytes) {
  const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  std::string tmp = (dir / fmt::format(".{}.XXXXXX", path.filename().string())).string();
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) return IoError("{}: cannot create a temporary file: {}", path.string(), std::strerror(errno));
  Status status;
  if (::fchmod(fd, 0644) != 0) status = IoError("{}: chmod: {}", path.string(), std::strerror(errno));
  while (status.ok() && !bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) status = IoError("{}: write failed: {}", path.string(), std::strerror(errno));
    if (n > 0) bytes.remove_prefix(size_t(n));
  }
  if (status.ok() && ::fsync(fd) != 0) status = IoError("{}: fsync failed: {}", path.string(), std::strerror(errno));
  if (::close(fd) != 0 && status.ok()) status = IoError("{}: close failed: {}", path.string(), std::strerror(errno));
  if (status.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    status = IoError("{}: rename failed: {}", path.string(), std::strerror(errno));
  }
  if (!status.ok()) {
    ::unlink(tmp.c_str());
    return status;
  }
  // The rename is durable only once the directory entry is.
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
  return Status::Ok();
}

}  // namespace estuary
