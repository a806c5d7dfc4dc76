#include "base/descriptors.h"

#include <sys/resource.h>

#include <cerrno>
#include <cstring>

namespace estuary {

Status EnsureDescriptors(uint64_t needed) {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return Internal("getrlimit(RLIMIT_NOFILE): {}", std::strerror(errno));
  if (limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur >= needed) return Status::Ok();
  if (limit.rlim_max != RLIM_INFINITY && limit.rlim_max < needed) {
    return FailedPrecondition("{} descriptors needed (one a connection), and this process may open at most {} "
                              "(the hard limit, ulimit -Hn)",
                              needed, uint64_t(limit.rlim_max));
  }
  limit.rlim_cur = rlim_t(needed);
  if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return Internal("setrlimit(RLIMIT_NOFILE, {}): {}", needed, std::strerror(errno));
  }
  return Status::Ok();
}

}  // namespace estuary
