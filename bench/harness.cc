#include "bench/harness.h"

#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace estuary::bench {

void Samples::Add(double value) {
  sorted_.insert(std::upper_bound(sorted_.begin(), sorted_.end(), value), value);
  sum_ += value;
}

std::string MedianAndRangeMs(const Samples& seconds) {
  return fmt::format("{:.1f} ms (range {:.1f}-{:.1f} over {})", seconds.median() * 1e3, seconds.min() * 1e3,
                     seconds.max() * 1e3, seconds.size());
}

Result<Samples> Repeat(const Repetitions& r, const std::function<Status()>& once) {
  for (int i = 0; i < r.warmup; ++i) ESTUARY_RETURN_IF_ERROR(once());
  Samples seconds;
  for (int i = 0; i < r.timed; ++i) {
    const Stopwatch watch;
    ESTUARY_RETURN_IF_ERROR(once());
    seconds.Add(watch.Seconds());
  }
  return seconds;
}

Result<double> SecondsPerCall(int calls, const std::function<Status()>& once, const std::function<Status()>& finish) {
  if (calls < 1) return InvalidArgument("bench: {} calls to time", calls);
  const Stopwatch watch;
  for (int i = 0; i < calls; ++i) ESTUARY_RETURN_IF_ERROR(once());
  if (finish) ESTUARY_RETURN_IF_ERROR(finish());
  return watch.Seconds() / calls;
}

void PrintRatio(std::string_view compared, double ratio, int decimals) {
  fmt::print("ratio ({}): {:.{}f}\n", compared, ratio, decimals);
}

void PrintRatio(std::string_view compared, const std::vector<std::pair<std::string, double>>& ratios, int decimals) {
  std::string figures;
  for (const auto& [what, ratio] : ratios) {
    figures += fmt::format("{}{} {:.{}f}", figures.empty() ? "" : ", ", what, ratio, decimals);
  }
  fmt::print("ratio ({}): {}\n", compared, figures);
}

Status RunCommand(const std::string& command, const std::function<void(std::string_view line)>& line) {
  // Whatever this process printed goes out before the child's output can.
  std::fflush(stdout);
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return IoError("cannot run {}", command);
  std::string text;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) {
    text.append(buffer, n);
    size_t end;
    while ((end = text.find('\n')) != std::string::npos) {
      line(std::string_view(text).substr(0, end));
      text.erase(0, end + 1);
    }
  }
  if (!text.empty()) line(text);
  const int status = pclose(pipe);
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return Internal("{} failed ({})", command,
                    status != -1 && WIFEXITED(status) ? fmt::format("exit status {}", WEXITSTATUS(status))
                                                      : std::string("killed or not waited for"));
  }
  return Status::Ok();
}

Result<std::string> CommandOutput(const std::string& command) {
  std::string out;
  ESTUARY_RETURN_IF_ERROR(RunCommand(command, [&](std::string_view line) {
    out.append(line);
    out += '\n';
  }));
  return out;
}

Result<std::unique_ptr<LineChild>> LineChild::Start(const std::string& command) {
  // A socket rather than two pipes: one descriptor each way, and send() can
  // refuse SIGPIPE (MSG_NOSIGNAL) when the child has died.
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    return IoError("cannot make a socket for {}: {}", command, std::strerror(errno));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  std::string shell = "/bin/sh", dash_c = "-c", line = command;
  char* argv[] = {shell.data(), dash_c.data(), line.data(), nullptr};
  std::fflush(stdout);
  pid_t pid = -1;
  const int error = posix_spawn(&pid, argv[0], &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (error != 0) {
    close(fds[0]);
    return IoError("cannot run {}: {}", command, std::strerror(error));
  }
  return std::unique_ptr<LineChild>(new LineChild(command, pid, fds[0]));
}

LineChild::~LineChild() {
  if (fd_ >= 0) close(fd_);
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

Status LineChild::Send(std::string_view line) {
  std::string text = fmt::format("{}\n", line);
  std::string_view rest = text;
  while (!rest.empty()) {
    const ssize_t n = send(fd_, rest.data(), rest.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return IoError("cannot write to {}: {}", command_, std::strerror(errno));
    rest.remove_prefix(size_t(n));
  }
  return Status::Ok();
}

Result<std::string> LineChild::Receive() {
  size_t end;
  while ((end = pending_.find('\n')) == std::string::npos) {
    char buffer[4096];
    const ssize_t n = recv(fd_, buffer, sizeof buffer, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return IoError("cannot read from {}: {}", command_, std::strerror(errno));
    if (n == 0) return Internal("{} ended its output before a line was expected of it", command_);
    pending_.append(buffer, size_t(n));
  }
  std::string line = pending_.substr(0, end);
  pending_.erase(0, end + 1);
  return line;
}

Status LineChild::Finish() {
  shutdown(fd_, SHUT_WR);  // the child reads end of input
  close(fd_);
  fd_ = -1;
  int status = 0;
  const pid_t waited = waitpid(pid_, &status, 0);
  pid_ = -1;
  if (waited < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return Internal("{} failed ({})", command_,
                    waited >= 0 && WIFEXITED(status) ? fmt::format("exit status {}", WEXITSTATUS(status))
                                                     : std::string("killed or not waited for"));
  }
  return Status::Ok();
}

std::string ScriptCommand(const std::string& python, std::string_view script) {
  return fmt::format("{} {}/bench/{}", python, ESTUARY_SOURCE_DIR, script);
}

CLI::Validator AtLeast(int least) {
  return CLI::Validator(
      [least](std::string& text) -> std::string {
        int value = 0;
        const char* end = text.data() + text.size();
        const auto parsed = std::from_chars(text.data(), end, value);
        if (parsed.ec == std::errc() && parsed.ptr == end && value >= least) return {};
        return fmt::format("{} is not a whole number of at least {}", text, least);
      },
      fmt::format(">= {}", least));
}

void Bench::AddRepetitions(Repetitions& r) {
  app_.add_option("--steps", r.timed, "timed steps")->check(AtLeast(1));
  app_.add_option("--warmup", r.warmup, "untimed steps first")->check(AtLeast(0));
}

void Bench::AddThreads(int& threads, const std::string& help) {
  app_.add_option("--threads", threads, help)->check(AtLeast(1));
}

void Bench::AddPython(std::string& python) {
  app_.add_option("--python", python, "the Python (with PyTorch) that runs the baseline");
}

void Bench::AddPrecision(DType& dtype, const std::string& help) {
  const CLI::Validator known(
      [](std::string& name) {
        auto parsed = ParseDType(name);
        return parsed.ok() ? std::string() : parsed.status().message();
      },
      "f32|bf16|f16");
  app_.add_option_function<std::string>(
          "--precision", [&dtype](const std::string& name) { dtype = *ParseDType(name); }, help)
      ->check(known)
      ->default_str(std::string(DTypeName(dtype)));
}

std::optional<int> Bench::Parse(int argc, char** argv) {
  try {
    app_.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app_.exit(e);
  }
  return std::nullopt;
}

int Bench::Fail(const Status& status) const {
  fmt::print(stderr, "{}: {}\n", name_, status.ToString());
  return 1;
}

int Bench::NothingMeasured(std::string_view why) const {
  fmt::print("{}: nothing measured: {}\n", name_, why);
  return 0;
}

}  // namespace estuary::bench
