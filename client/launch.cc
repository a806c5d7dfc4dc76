#include "client/launch.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstring>
#include <set>

#include <fmt/format.h>

#include "base/split.h"

namespace estuary::client {

namespace {

Result<std::vector<int>> ParseGpus(const std::string& list, const std::function<Result<int>()>& gpu_count) {
  auto visible = gpu_count();
  if (!visible.ok()) return FailedPrecondition("--gpus {}: {}", list, visible.status().message());
  const int count = *visible;
  std::vector<int> gpus;
  if (list == "all") {
    if (count == 0) return FailedPrecondition("--gpus all: no CUDA device is visible");
    for (int i = 0; i < count; ++i) gpus.push_back(i);
    return gpus;
  }
  std::set<int> seen;
  for (const std::string& item : SplitCommas(list)) {
    int gpu = -1;
    auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), gpu);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size() || gpu < 0) {
      return InvalidArgument("--gpus '{}': expected all or a list of device numbers such as 0,1", list);
    }
    if (gpu >= count) return InvalidArgument("--gpus {}: device {} is not visible ({} CUDA device(s))", list, gpu, count);
    if (!seen.insert(gpu).second) return InvalidArgument("--gpus {}: device {} is listed twice", list, gpu);
    gpus.push_back(gpu);
  }
  if (gpus.empty()) return InvalidArgument("--gpus '': expected all or a list of device numbers such as 0,1");
  return gpus;
}

}  // namespace

Result<SiteLayout> MakeSiteLayout(const SiteFlags& flags, const std::function<Result<int>()>& gpu_count) {
  SiteLayout layout;
  if (flags.ranks < 1) return InvalidArgument("--ranks {}: must be at least 1", flags.ranks);
  if (flags.zero < 0 || flags.zero > 3) {
    return InvalidArgument("--zero {}: expected 0 (DDP), 1, 2 or 3", flags.zero);
  }
  if (flags.nodes < 1) return InvalidArgument("--nodes {}: must be at least 1", flags.nodes);
  if (flags.node_rank < 0 || flags.node_rank >= flags.nodes) {
    return InvalidArgument("--node-rank {}: must be in [0, --nodes {})", flags.node_rank, flags.nodes);
  }
  if (!(flags.rank_timeout_s > 0) || !std::isfinite(flags.rank_timeout_s) || flags.rank_timeout_s > 86400) {
    return InvalidArgument("--rank-timeout {}: must be a number of seconds in (0, 86400]", flags.rank_timeout_s);
  }
  if (!flags.backend.empty() && flags.backend != "gloo" && flags.backend != "nccl") {
    return InvalidArgument("--backend '{}': expected gloo or nccl", flags.backend);
  }
  if (!flags.rendezvous.empty() && !flags.rendezvous.starts_with("tcp://") && !flags.rendezvous.starts_with("file://")) {
    return InvalidArgument("--rendezvous '{}': expected tcp://HOST:PORT or file:///DIR", flags.rendezvous);
  }
  if (flags.nodes > 1 && flags.rendezvous.empty()) {
    return InvalidArgument("--nodes {}: a multi-node site needs --rendezvous tcp://HOST:PORT (node 0's address)",
                           flags.nodes);
  }
  if (!flags.gpus.empty()) {
    if (flags.ranks != 1) return InvalidArgument("--gpus and --ranks {}: --gpus runs one rank per GPU", flags.ranks);
    if (flags.backend == "gloo") return InvalidArgument("--gpus with --backend gloo: GPUs use --backend nccl");
    ESTUARY_ASSIGN_OR_RETURN(layout.gpus, ParseGpus(flags.gpus, gpu_count));
    layout.local_ranks = int(layout.gpus.size());
    layout.backend = "nccl";
  } else {
    if (flags.backend == "nccl") return InvalidArgument("--backend nccl: name the GPUs with --gpus all|0,1,...");
    layout.local_ranks = flags.ranks;
  }
  if (flags.local_rank < 0 || flags.local_rank >= layout.local_ranks) {
    return InvalidArgument("--local-rank {}: not in [0, {})", flags.local_rank, layout.local_ranks);
  }
  layout.nodes = flags.nodes;
  layout.node_rank = flags.node_rank;
  layout.local_rank = flags.local_rank;
  layout.zero = parallel::ZeroStage(flags.zero);
  layout.rendezvous = flags.rendezvous;
  layout.timeout = std::chrono::milliseconds(int64_t(flags.rank_timeout_s * 1000));
  return layout;
}

Result<pid_t> SpawnRank(const std::vector<std::string>& args) {
  // Everything the child needs is built before fork: after it, only
  // async-signal-safe calls (the parent has threads).
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return IoError("launch: fork: {}", std::strerror(errno));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the parent died before prctl took effect
    execv("/proc/self/exe", argv.data());
    _exit(127);
  }
  return pid;
}

std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  }
  return fmt::format("ended with wait status {:#x}", status);
}

}  // namespace estuary::client
