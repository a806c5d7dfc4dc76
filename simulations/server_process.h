// ServerProcess: an estuary-server running as a child process.
//
// Spawn() starts it with stdout on a pipe and stderr in a log file;
// WaitForPort() reads stdout until the "listening on HOST:PORT" line, so a
// caller can ask for port 0 and still learn the port without polling. The
// destructor terminates a child that is still running and reaps it. Used by
// the loopback simulator and by the end-to-end tests.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"

namespace estuary::simulations {

class ServerProcess {
 public:
  ServerProcess() = default;
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;
  ~ServerProcess();

  Status Spawn(const std::filesystem::path& binary, const std::vector<std::string>& args,
               const std::filesystem::path& log);
  Result<uint16_t> WaitForPort();
  // The next line the server writes to standard output after that one
  // (e.g. "metrics on http://HOST:PORT/metrics"), without its newline.
  Result<std::string> NextLine();
  // The exit status if the child has exited (128 + signal if killed), else nullopt.
  std::optional<int> Poll();
  int Wait();
  // SIGKILL, then reap: a crash, for restart tests.
  void Kill();
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int stdout_fd_ = -1;
  std::filesystem::path log_;
};

// estuary-server beside the running program, or in the build tree's server/.
std::filesystem::path FindServerBinary();

}  // namespace estuary::simulations
