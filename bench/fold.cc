// bench/fold: how fast the server folds updates (WeightedMean::Add, the
// fold of FedAvg, FedAvgM and FedOpt), against what memory allows and
// against NumPy, in one run.
//
// - The floor: STREAM's triad a = b + s·c over float arrays as large as an
//   update, on one thread and on every core, in bytes moved per second (12 a
//   element). The fold must move 24 bytes an element — the update read twice
//   (the finiteness check, then the sum: 4 + 4) and the double-precision sum
//   read and written (16) — so at the triad's bandwidth it could fold
//   updates at triad / 6 bytes of update per second; the ratio printed is
//   the fold's rate over that.
// - NumPy: `acc += w * update` into a float64 accumulator, the weighted sum a
//   Python framework computes, one thread (OpenBLAS and OpenMP pinned to 1).
//
// Default: 8 updates of 16 M floats (64 MB each), medians of 5 timed passes.
//   build/bench/fold [--floats 16777216] [--updates 8] [--threads 0 (all)] [--python python3]
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "aggregation/weighted_mean.h"
#include "bench/harness.h"

namespace {

using namespace estuary;

// Seconds of one call of fn, the median of `reps` after one warm-up.
template <typename Fn>
double Median(int reps, const Fn& fn) {
  fn();
  std::vector<double> seconds;
  for (int i = 0; i < reps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

// The triad over `threads` contiguous ranges; bytes per second moved.
double TriadBandwidth(std::vector<float>& a, const std::vector<float>& b, const std::vector<float>& c, int threads,
                      int reps) {
  const size_t n = a.size();
  auto range = [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) a[i] = b[i] + 3.0f * c[i];
  };
  const double seconds = Median(reps, [&] {
    std::vector<std::thread> helpers;
    const size_t per = (n + threads - 1) / threads;
    for (int t = 0; t + 1 < threads; ++t) helpers.emplace_back(range, t * per, std::min(n, (t + 1) * per));
    range((threads - 1) * per, n);
    for (auto& h : helpers) h.join();
  });
  return 12.0 * double(n) / seconds;
}

}  // namespace

int main(int argc, char** argv) {
  bench::Bench bench("fold", "The server's fold (weighted sum of updates) against memory bandwidth and NumPy");
  size_t floats = size_t(1) << 24;
  int updates = 8, threads = 0, reps = 5;
  std::string python = "/usr/bin/python3";
  CLI::App& app = bench.app();
  app.add_option("--floats", floats, "values per update");
  app.add_option("--updates", updates, "updates folded per pass")->check(bench::AtLeast(1));
  app.add_option("--threads", threads, "threads for the all-cores figures (0: every core)");
  app.add_option("--reps", reps, "timed passes")->check(bench::AtLeast(1));
  bench.AddPython(python);
  if (auto code = bench.Parse(argc, argv)) return *code;
  if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));

  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 0.01f);
  std::vector<std::vector<float>> deltas(updates, std::vector<float>(floats));
  for (auto& d : deltas) {
    for (float& x : d) x = normal(rng);
  }
  std::vector<float> a(floats), b(deltas[0]), c(floats, 1.0f);

  fmt::print("{} updates of {} floats ({:.0f} MB each); {} threads for the all-cores figures\n", updates, floats,
             double(floats) * 4 / 1e6, threads);
  const double update_bytes = double(updates) * double(floats) * 4;
  for (int t : {1, threads}) {
    const double triad = TriadBandwidth(a, b, c, t, reps);
    aggregation::WeightedMean mean;
    mean.set_threads(t);
    Status failed;
    const double seconds = Median(reps, [&] {
      mean.Reset(floats);
      for (int u = 0; u < updates; ++u) {
        if (Status s = mean.Add(deltas[u], 10.0 + u); !s.ok()) failed = s;
      }
    });
    if (!failed.ok()) return bench.Fail(failed);
    const double rate = update_bytes / seconds;
    const double floor = triad / 6.0;
    fmt::print("{} thread{}: triad {:.2f} GB/s; fold {:.2f} GB/s of updates ({:.1f} ms a pass), {:.2f} of the {:.2f} GB/s "
               "the triad's bandwidth allows at 24 bytes an element\n",
               t, t == 1 ? "" : "s", triad / 1e9, rate / 1e9, seconds * 1e3, rate / floor, floor / 1e9);
    bench::PrintRatio(fmt::format("fold / triad floor, {} thread{}", t, t == 1 ? "" : "s"), rate / floor);
    if (t == 1) {
      const std::string command = fmt::format(
          "OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 {} -c \"import numpy as np, time\n"
          "n, k = {}, {}\nrng = np.random.default_rng(5)\nds = [rng.standard_normal(n, dtype=np.float32) * 0.01 "
          "for _ in range(k)]\nbest = []\nfor rep in range({}):\n  acc = np.zeros(n)\n  t = time.perf_counter()\n"
          "  for i, d in enumerate(ds): acc += (10.0 + i) * d\n  best.append(time.perf_counter() - t)\n"
          "print(sorted(best)[len(best) // 2])\"",
          python, floats, updates, reps + 1);
      auto out = bench::CommandOutput(command);
      if (!out.ok()) {
        fmt::print("numpy: not run ({})\n", out.status().message());
      } else {
        const double numpy_seconds = std::stod(*out);
        fmt::print("numpy acc += w * update (float64 accumulator, 1 thread): {:.2f} GB/s of updates ({:.1f} ms)\n",
                   update_bytes / numpy_seconds / 1e9, numpy_seconds * 1e3);
        bench::PrintRatio("estuary fold / numpy, 1 thread", numpy_seconds / seconds);
      }
    }
    if (threads == 1) break;
  }
  return 0;
}
