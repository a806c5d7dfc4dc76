// For the data-parallel benchmarks: run n ranks as child processes forked
// from the benchmark (before it builds any model, so each starts small),
// meeting at a free tcp:// address on 127.0.0.1, and collect one fixed-size
// record of figures from every rank through a pipe. A rank that fails prints
// its own message; the benchmark then exits 1 naming itself.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "comm/rendezvous.h"

namespace estuary::bench {

// body(rank, address) runs in rank's process and returns its figures.
template <typename Figures, typename Body>
std::vector<Figures> RunRanks(const char* who, int n, Body&& body) {
  static_assert(std::is_trivially_copyable_v<Figures>, "figures travel through a pipe as bytes");
  auto address = comm::FreeLoopbackRendezvous();
  int fds[2];
  if (!address.ok() || pipe(fds) != 0) {
    std::fprintf(stderr, "%s: cannot set up the ranks: %s\n", who,
                 address.ok() ? "pipe failed" : address.status().ToString().c_str());
    std::exit(1);
  }
  std::vector<pid_t> pids;
  for (int rank = 0; rank < n; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      close(fds[0]);
      const Figures f = body(rank, *address);
      _exit(write(fds[1], &f, sizeof(f)) == ssize_t(sizeof(f)) ? 0 : 1);
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
  if (!ok) {
    std::fprintf(stderr, "%s: a rank failed (its message is above)\n", who);
    std::exit(1);
  }
  return out;
}

}  // namespace estuary::bench
