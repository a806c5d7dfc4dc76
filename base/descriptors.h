// The process's descriptor limit, for what holds one connection a site.
//
// EnsureDescriptors(n) raises the soft RLIMIT_NOFILE to n when it is lower,
// never past the hard limit and never system-wide: a child process started
// afterwards inherits it. When the hard limit is under n it changes nothing
// and says so in one line naming both figures (`ulimit -Hn` is what to raise).
#pragma once

#include <cstdint>

#include "base/status.h"

namespace estuary {

Status EnsureDescriptors(uint64_t needed);

}  // namespace estuary
