#include "simulations/server_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

extern char** environ;

namespace estuary::simulations {

namespace fs = std::filesystem;

static int ExitCode(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

ServerProcess::~ServerProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGTERM);
    int status;
    waitpid(pid_, &status, 0);
  }
  if (stdout_fd_ >= 0) close(stdout_fd_);
}

Status ServerProcess::Spawn(const fs::path& binary, const std::vector<std::string>& args, const fs::path& log) {
  log_ = log;
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return IoError("server process: pipe: {}", std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::string program = binary.string();
  std::vector<std::string> copy = args;
  std::vector<char*> argv = {program.data()};
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  const int rc = posix_spawn(&pid_, program.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(out[1]);
  stdout_fd_ = out[0];
  if (rc != 0) {
    pid_ = -1;
    return IoError("server process: cannot start {}: {}", program, std::strerror(rc));
  }
  return Status::Ok();
}

Result<uint16_t> ServerProcess::WaitForPort() {
  std::string line;
  char c;
  while (read(stdout_fd_, &c, 1) == 1) {
    if (c != '\n') {
      line += c;
      continue;
    }
    const auto colon = line.rfind(':');
    if (line.rfind("listening on ", 0) == 0 && colon != std::string::npos) {
      return static_cast<uint16_t>(std::stoi(line.substr(colon + 1)));
    }
    line.clear();
  }
  return Aborted("estuary-server exited before listening; see {}", log_.string());
}

Result<std::string> ServerProcess::NextLine() {
  std::string line;
  char c;
  while (read(stdout_fd_, &c, 1) == 1) {
    if (c == '\n') return line;
    line += c;
  }
  return Aborted("estuary-server closed its standard output; see {}", log_.string());
}

std::optional<int> ServerProcess::Poll() {
  if (pid_ <= 0) return 0;
  int status;
  if (waitpid(pid_, &status, WNOHANG) == pid_) {
    pid_ = -1;
    return ExitCode(status);
  }
  return std::nullopt;
}

int ServerProcess::Wait() {
  if (pid_ <= 0) return 0;
  int status;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return ExitCode(status);
}

void ServerProcess::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  Wait();
}

fs::path FindServerBinary() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  const fs::path build = self.parent_path().parent_path();
  for (const fs::path& candidate : {self.parent_path() / "estuary-server", build / "server" / "estuary-server",
                                    build.parent_path() / "server" / "estuary-server"}) {
    if (fs::exists(candidate)) return candidate;
  }
  return "estuary-server";
}

}  // namespace estuary::simulations
