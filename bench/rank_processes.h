// For the data-parallel benchmarks: run n ranks as child processes forked
// from the benchmark (before it builds any model, so each starts small),
// meeting at a free tcp:// address on 127.0.0.1, and collect one fixed-size
// record of figures from every rank through a pipe. A rank that fails prints
// its own message, "who: rank r: error"; RunRanks then returns an error.
#pragma once

#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <type_traits>
#include <vector>

#include "base/status.h"
#include "comm/rendezvous.h"

namespace estuary::bench {

// body(rank, address) runs in rank's process and returns its figures.
template <typename Figures, typename Body>
Result<std::vector<Figures>> RunRanks(const char* who, int n, Body&& body) {
  static_assert(std::is_trivially_copyable_v<Figures>, "figures travel through a pipe as bytes");
  auto address = comm::FreeLoopbackRendezvous();
  if (!address.ok()) return address.status();
  int fds[2];
  if (pipe(fds) != 0) return IoError("no pipe for the ranks' figures");
  std::vector<pid_t> pids;
  for (int rank = 0; rank < n; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      close(fds[0]);
      const Result<Figures> f = body(rank, *address);
      if (!f.ok()) {
        fmt::print(stderr, "{}: rank {}: {}\n", who, rank, f.status().ToString());
        _exit(1);
      }
      _exit(write(fds[1], &*f, sizeof(Figures)) == ssize_t(sizeof(Figures)) ? 0 : 1);
    }
    pids.push_back(pid);
  }
  close(fds[1]);
  std::vector<Figures> out(n);
  size_t got = 0;
  while (got < out.size() && read(fds[0], &out[got], sizeof(Figures)) == ssize_t(sizeof(Figures))) ++got;
  close(fds[0]);
  bool ok = got == out.size();
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  if (!ok) return Internal("a rank failed (its message is above)");
  return out;
}

}  // namespace estuary::bench
