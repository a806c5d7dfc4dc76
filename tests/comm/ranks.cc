#include "tests/comm/ranks.h"
#include "comm/rendezvous.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace estuary::comm::testing {

using Clock = std::chrono::steady_clock;

std::string RankOutcome::Describe() const {
  if (timed_out) return fmt::format("rank {} was still running at the limit and was killed", rank);
  if (signal != 0) return fmt::format("rank {} was killed by signal {} ({})", rank, signal, strsignal(signal));
  return fmt::format("rank {} exited with {}", rank, exit_code);
}

std::vector<RankOutcome> RunRanks(const std::vector<int>& ranks, const std::function<Status(int)>& body,
                                  std::chrono::seconds limit) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<RankOutcome> outcomes(ranks.size());
  std::vector<pid_t> pids(ranks.size(), -1);
  std::vector<int> pidfds(ranks.size(), -1);
  for (size_t i = 0; i < ranks.size(); ++i) {
    outcomes[i].rank = ranks[i];
    const pid_t pid = fork();
    if (pid == 0) {
      int code = 0;
      try {
        Status status = body(ranks[i]);
        if (!status.ok()) {
          std::fprintf(stderr, "rank %d: %s\n", ranks[i], status.ToString().c_str());
          code = 1;
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: exception: %s\n", ranks[i], e.what());
        code = 2;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(code);  // no atexit handlers: they belong to the parent's test run
    }
    pids[i] = pid;
    pidfds[i] = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  }

  // Wait on the children's pidfds, so the limit needs no polling loop.
  const auto deadline = Clock::now() + limit;
  size_t running = ranks.size();
  while (running > 0) {
    std::vector<pollfd> fds;
    std::vector<size_t> which;
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (pids[i] > 0) {
        fds.push_back({pidfds[i], POLLIN, 0});
        which.push_back(i);
      }
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    const int ready = left > 0 ? poll(fds.data(), fds.size(), static_cast<int>(left)) : 0;
    if (ready <= 0) {
      if (ready < 0 && errno == EINTR) continue;
      for (size_t i : which) {
        kill(pids[i], SIGKILL);
        outcomes[i].timed_out = true;
      }
    }
    for (size_t k = 0; k < fds.size(); ++k) {
      const size_t i = which[k];
      if (ready > 0 && !(fds[k].revents & POLLIN)) continue;
      int status = 0;
      waitpid(pids[i], &status, 0);
      if (WIFEXITED(status)) outcomes[i].exit_code = WEXITSTATUS(status);
      if (WIFSIGNALED(status)) outcomes[i].signal = WTERMSIG(status);
      close(pidfds[i]);
      pids[i] = -1;
      --running;
    }
  }
  return outcomes;
}

std::vector<RankOutcome> RunRanks(int size, const std::function<Status(int)>& body, std::chrono::seconds limit) {
  std::vector<int> ranks(size);
  for (int r = 0; r < size; ++r) ranks[r] = r;
  return RunRanks(ranks, body, limit);
}

std::string FreeTcpAddress() {
  auto address = FreeLoopbackRendezvous();
  if (!address.ok()) {
    std::fprintf(stderr, "FreeTcpAddress: %s\n", address.status().ToString().c_str());
    std::abort();
  }
  return *address;
}

std::string FreshDirAddress() {
  std::string dir = (std::filesystem::temp_directory_path() / "estuary-comm-XXXXXX").string();
  if (mkdtemp(dir.data()) == nullptr) {
    std::perror("FreshDirAddress");
    std::abort();
  }
  return "file://" + dir;
}

}  // namespace estuary::comm::testing
