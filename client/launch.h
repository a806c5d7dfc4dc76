// Launch: how estuary-client turns one command into the ranks of a site.
//
//   estuary-client ... --ranks N --backend gloo [--zero 0|1|2|3]      N CPU processes
//   estuary-client ... --gpus all|0,1,...  [--backend nccl]           one rank per GPU
//   ... --nodes M --node-rank K --rendezvous tcp://HOST:PORT          M nodes, this one is K
//
// The process started by hand is local rank 0 of its node; it starts local
// ranks 1..N-1 as children running the same binary (/proc/self/exe) with the
// same arguments plus an internal --local-rank (and, on a single node
// without --rendezvous, the tcp:// address on 127.0.0.1 it picked). The
// children die with it (PR_SET_PDEATHSIG) and it reaps them. Global rank
// node_rank * N + local_rank; global rank 0 alone talks to the server.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "base/status.h"
#include "comm/rendezvous.h"
#include "parallel/data_parallel.h"

namespace estuary::client {

// The flags as given.
struct SiteFlags {
  int ranks = 1;
  std::string backend;  // empty: gloo, or nccl with --gpus
  std::string gpus;     // empty, "all" or "0,1,..."
  int zero = 0;
  int nodes = 1;
  int node_rank = 0;
  std::string rendezvous;
  double rank_timeout_s = 60;
  int local_rank = 0;  // internal: set by the launcher for its children
};

// The site they describe, checked.
struct SiteLayout {
  int local_ranks = 1;
  int nodes = 1;
  int node_rank = 0;
  int local_rank = 0;
  std::string backend = "gloo";
  std::vector<int> gpus;  // nccl: the GPU of each local rank
  parallel::ZeroStage zero = parallel::ZeroStage::kDdp;
  std::string rendezvous;  // empty until the launcher picks one (single node)
  std::chrono::milliseconds timeout{60000};

  int world() const { return local_ranks * nodes; }
  int global_rank() const { return node_rank * local_ranks + local_rank; }
  // One rank in all: the plain single-process client.
  bool multi_rank() const { return world() > 1; }
};

// Checks the flags; every error is one line naming the flag, e.g.
// "--zero 4: expected 0 (DDP), 1, 2 or 3". gpu_count is asked only for
// --gpus all and to check a GPU list; it fails in a build without CUDA.
Result<SiteLayout> MakeSiteLayout(const SiteFlags& flags, const std::function<Result<int>()>& gpu_count);

// Starts a child running /proc/self/exe with args (args[0] is its argv[0]);
// it gets SIGKILL when this thread's process dies.
Result<pid_t> SpawnRank(const std::vector<std::string>& args);

// "exited with status 3", "was killed by signal 9 (Killed)".
std::string DescribeWaitStatus(int status);

}  // namespace estuary::client
