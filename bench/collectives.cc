// Bus bandwidth of the communicator's collectives, as nccl-tests defines it:
// algbw = size / time; busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for
// reduce-scatter and all-gather, x 1 for broadcast, where size is the larger of
// the operation's input and output. The baseline, in the same run, is a plain
// copy of the same bytes on rank 0 (memcpy on the host for Gloo, a device to
// device cudaMemcpy for NCCL); the last column is busbw over it.
//
//   build/bench/collectives                      # Gloo, 2 processes on this machine
//   build/bench/collectives --ranks 4 --max-bytes 16M
//   build/bench/collectives --backend nccl       # one process per visible GPU
//
// Every rank is a process forked before any thread or CUDA context exists;
// they meet through a fresh file:// rendezvous directory.
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <vector>

#include "bench/harness.h"
#include "comm/gloo_communicator.h"
#ifdef ESTUARY_HAVE_NCCL
#include <cuda_runtime_api.h>

#include "comm/nccl_communicator.h"
#endif

namespace {

using namespace estuary;
using namespace estuary::comm;

// Where a rank's buffers live, and the baseline copy there.
struct Memory {
  std::function<float*(size_t floats)> alloc;
  std::function<void(float*)> release;
  // Seconds per copy of `bytes` from src to dst, over `iters` copies.
  std::function<Result<double>(float* dst, const float* src, size_t bytes, int iters)> copy_seconds;
};

Memory HostMemory() {
  return {[](size_t n) { return static_cast<float*>(std::calloc(std::max<size_t>(n, 1), sizeof(float))); },
          [](float* p) { std::free(p); },
          [](float* dst, const float* src, size_t bytes, int iters) {
            return bench::SecondsPerCall(iters, [&] {
              std::memcpy(dst, src, bytes);
              asm volatile("" : : "r"(dst) : "memory");  // keep every copy
              return Status::Ok();
            });
          }};
}

#ifdef ESTUARY_HAVE_NCCL
Memory DeviceMemory() {
  return {[](size_t n) {
            void* p = nullptr;
            const size_t bytes = std::max<size_t>(n, 1) * sizeof(float);
            if (cudaMalloc(&p, bytes) != cudaSuccess) return static_cast<float*>(nullptr);
            cudaMemset(p, 0, bytes);
            return static_cast<float*>(p);
          },
          [](float* p) { cudaFree(p); },
          [](float* dst, const float* src, size_t bytes, int iters) {
            cudaDeviceSynchronize();
            return bench::SecondsPerCall(
                iters,
                [&] {
                  cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, nullptr);
                  return Status::Ok();
                },
                [] {
                  cudaDeviceSynchronize();
                  return Status::Ok();
                });
          }};
}
#endif

// Enough repetitions for ~256 MiB moved per measurement, at least 5.
int Iterations(size_t bytes) { return static_cast<int>(std::clamp<size_t>((256u << 20) / bytes, 5, 200)); }

Status RunRank(Communicator& c, const Memory& memory, size_t min_bytes, size_t max_bytes) {
  const int n = c.size();
  const bool print = c.rank() == 0;
  if (print) {
    fmt::print("{}, {} ranks; size = the larger of input and output; baseline: one copy of size bytes on rank 0\n",
               c.backend(), n);
    fmt::print("{:>10}  {:<15}{:>11}{:>13}{:>13}{:>14}{:>10}\n", "size", "collective", "time (us)", "algbw GB/s",
               "busbw GB/s", "copy GB/s", "ratio");
  }
  for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
    // Sizes split evenly into n blocks of whole floats.
    const size_t floats = bytes / sizeof(float) / n * n;
    if (floats == 0) continue;
    const size_t size_bytes = floats * sizeof(float);
    float* a = memory.alloc(floats);
    float* b = memory.alloc(floats);
    if (a == nullptr || b == nullptr) return Internal("cannot allocate {} bytes", size_bytes);
    const std::span<float> full(a, floats), block(b, floats / n);
    const int iters = Iterations(size_bytes);
    double copy = 0;
    if (print) {
      ESTUARY_ASSIGN_OR_RETURN(copy, memory.copy_seconds(b, a, size_bytes, iters));
    }

    struct Case {
      const char* name;
      double bus_factor;
      std::function<std::unique_ptr<Work>()> launch;
    };
    const Case cases[] = {
        {"all-reduce", 2.0 * (n - 1) / n, [&] { return c.AllReduce(full, ReduceOp::kSum); }},
        {"reduce-scatter", double(n - 1) / n, [&] { return c.ReduceScatter(full, block, ReduceOp::kSum); }},
        {"all-gather", double(n - 1) / n, [&] { return c.AllGather(block, full); }},
        {"broadcast", 1.0, [&] { return c.Broadcast(full, 0); }},
    };
    for (const auto& test : cases) {
      ESTUARY_RETURN_IF_ERROR(test.launch()->Wait());  // warm up: connections, caches
      ESTUARY_RETURN_IF_ERROR(c.Barrier()->Wait());
      std::vector<std::unique_ptr<Work>> works;
      auto launch = [&] {
        works.push_back(test.launch());
        return Status::Ok();
      };
      auto wait_all = [&]() -> Status {
        for (auto& w : works) ESTUARY_RETURN_IF_ERROR(w->Wait());
        return Status::Ok();
      };
      ESTUARY_ASSIGN_OR_RETURN(const double seconds, bench::SecondsPerCall(iters, launch, wait_all));
      if (print) {
        const double algbw = size_bytes / seconds / 1e9, busbw = algbw * test.bus_factor;
        const double copy_bw = size_bytes / copy / 1e9;
        fmt::print("{:>10}  {:<15}{:>11.1f}{:>13.3f}{:>13.3f}{:>14.3f}{:>10.3f}\n", size_bytes, test.name,
                   seconds * 1e6, algbw, busbw, copy_bw, busbw / copy_bw);
        std::fflush(stdout);
      }
    }
    memory.release(a);
    memory.release(b);
  }
  return Status::Ok();
}

// Forks `ranks` processes running body(rank); returns how many failed.
int RunProcesses(int ranks, const std::function<int(int)>& body) {
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int r = 0; r < ranks; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      const int code = body(r);
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(code);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  return failed;
}

size_t ParseBytes(const std::string& text) {
  size_t end = 0;
  const double value = std::stod(text, &end);
  const std::string unit = text.substr(end);
  const double scale = unit == "K" ? 1 << 10 : unit == "M" ? 1 << 20 : unit == "G" ? 1 << 30 : 1;
  return static_cast<size_t>(value * scale);
}

}  // namespace

int main(int argc, char** argv) {
  bench::Bench bench("collectives", "Bus bandwidth of the communicator's collectives against a plain copy");
  std::string backend = "gloo", min_text = "1K", max_text = "64M";
  int ranks = 2;
  CLI::App& app = bench.app();
  app.add_option("--backend", backend, "gloo (CPU processes) or nccl (one process per visible GPU)")
      ->check(CLI::IsMember({"gloo", "nccl"}));
  app.add_option("--ranks", ranks, "Gloo processes")->check(CLI::Range(1, 64));
  app.add_option("--min-bytes", min_text, "smallest size (K, M suffixes)");
  app.add_option("--max-bytes", max_text, "largest size");
  if (auto code = bench.Parse(argc, argv)) return *code;
  const size_t min_bytes = ParseBytes(min_text), max_bytes = ParseBytes(max_text);

  std::string dir = (std::filesystem::temp_directory_path() / "estuary-bench-XXXXXX").string();
  if (mkdtemp(dir.data()) == nullptr) return bench.Fail(IoError("cannot make a rendezvous directory under {}", dir));
  const std::string address = "file://" + dir;
  // Each rank process says what went wrong itself.
  auto run_rank = [&](int rank, const Result<std::unique_ptr<Communicator>>& c, const Memory& memory) {
    const Status status = c.ok() ? RunRank(**c, memory, min_bytes, max_bytes) : c.status();
    if (!status.ok()) bench.Fail(Status(status.code(), fmt::format("rank {}: {}", rank, status.message())));
    return status.ok() ? 0 : 1;
  };
  int failed = 0;
  if (backend == "gloo") {
    failed = RunProcesses(ranks, [&](int rank) {
      const RendezvousOptions rendezvous{
          .address = address, .rank = rank, .size = ranks, .timeout = std::chrono::seconds(120)};
      return run_rank(rank, ConnectGloo(rendezvous, {.host = "127.0.0.1"}), HostMemory());
    });
  } else {
#ifndef ESTUARY_HAVE_NCCL
    std::filesystem::remove_all(dir);
    return bench.NothingMeasured("this build has no NCCL engine (CUDA or NCCL not found by CMake)");
#else
    // Count the GPUs in a child: a CUDA context in this process would not survive the forks.
    int gpus = 0;
    int fds[2];
    if (pipe(fds) != 0) return bench.Fail(IoError("pipe failed"));
    RunProcesses(1, [&](int) {
      int n = 0;
      if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
      return write(fds[1], &n, sizeof(n)) == sizeof(n) ? 0 : 1;
    });
    if (read(fds[0], &gpus, sizeof(gpus)) != sizeof(gpus)) gpus = 0;
    if (gpus == 0) {
      std::filesystem::remove_all(dir);
      return bench.NothingMeasured("no CUDA device visible for --backend nccl");
    }
    failed = RunProcesses(gpus, [&](int rank) {
      const RendezvousOptions rendezvous{
          .address = address, .rank = rank, .size = gpus, .timeout = std::chrono::seconds(120)};
      return run_rank(rank, ConnectNccl(rendezvous, rank), DeviceMemory());
    });
#endif
  }
  std::filesystem::remove_all(dir);
  return failed == 0 ? 0 : 1;
}
