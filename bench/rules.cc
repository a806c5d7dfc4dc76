// bench/rules: one round of each aggregation rule at a federation's scale —
// 100 sites' updates of the MNIST CNN by default — folded as the server folds
// them (Strategy::FoldShared: the robust rules keep each staged update rather
// than copying it) and finished into the new global model.
//
// The baseline is FedAvg in the same run: each rule's round time is printed
// as a ratio to it. The coordinate-wise median is also timed against NumPy's
// np.median over the same stacked updates (one thread), what a Python
// framework's median costs.
//
//   build/bench/rules [--sites 100] [--model cnn] [--reps 3] [--byzantine 10] [--rules median,krum]
//                     [--python python3]
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <random>
#include <vector>

#include "aggregation/strategy.h"
#include "base/split.h"
#include "bench/harness.h"
#include "models/model.h"

namespace {

using namespace estuary;

aggregation::StrategyOptions OptionsOf(const std::string& name, uint32_t byzantine) {
  aggregation::StrategyOptions o;
  o.name = name;
  o.server_lr = aggregation::DefaultServerLr(name);
  o.byzantine = byzantine;
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  bench::Bench bench("rules", "One round of each aggregation rule over a federation's updates, against FedAvg");
  int sites = 100, reps = 3;
  uint32_t byzantine = 10;
  std::string model = "cnn", python = "/usr/bin/python3";
  CLI::App& app = bench.app();
  app.add_option("--sites", sites, "updates folded a round")->check(bench::AtLeast(1));
  app.add_option("--model", model, "whose parameter count an update has: mlp | cnn");
  app.add_option("--reps", reps, "timed rounds per rule")->check(bench::AtLeast(1));
  app.add_option("--byzantine", byzantine, "f for krum, multi-krum and bulyan");
  std::string only;
  app.add_option("--rules", only, "comma-separated rules to time (default: every one)");
  bench.AddPython(python);
  if (auto code = bench.Parse(argc, argv)) return *code;

  auto made = models::MakeModel(model);
  if (!made.ok()) return bench.Fail(made.status());
  const size_t size = (*made)->manifest().total_elements;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 0.01f);
  std::vector<std::shared_ptr<const std::vector<float>>> updates;
  for (int i = 0; i < sites; ++i) {
    auto d = std::make_shared<std::vector<float>>(size);
    for (float& x : *d) x = normal(rng);
    updates.push_back(std::move(d));
  }
  const std::vector<float> start(size, 0.1f);
  std::vector<float> global(size);
  const double round_bytes = double(sites) * double(size) * 4;
  fmt::print("{} updates of {}'s {} parameters ({:.1f} MB a round); median of {} rounds each\n", sites, model, size,
             round_bytes / 1e6, reps);

  // A round of `strategy`, timed.
  auto time_round = [&](aggregation::Strategy& strategy) -> Result<double> {
    const bench::Stopwatch watch;
    ESTUARY_RETURN_IF_ERROR(strategy.Begin(1, start));
    for (int i = 0; i < sites; ++i) {
      // Local work as a site of plain SGD reports it (FedNova reads it; the others fold as FoldShared).
      const aggregation::LocalWork work{.steps = uint64_t(5 + i), .normalizer = 5.0 + i};
      ESTUARY_RETURN_IF_ERROR(
          strategy.FoldWork("site", Manifest{}, updates[size_t(i)], *updates[size_t(i)], 10.0 + i, work));
    }
    ESTUARY_RETURN_IF_ERROR(strategy.Finish(global));
    return watch.Seconds();
  };
  auto fedavg = aggregation::MakeStrategy(OptionsOf("fedavg", byzantine));
  if (!fedavg.ok()) return bench.Fail(fedavg.status());
  const std::vector<std::string> chosen = SplitCommas(only);
  for (const char* name : aggregation::kStrategyNames) {
    if (!chosen.empty() && std::find(chosen.begin(), chosen.end(), name) == chosen.end()) continue;
    auto strategy = aggregation::MakeStrategy(OptionsOf(name, byzantine));
    if (!strategy.ok()) return bench.Fail(strategy.status());
    // FedAvg's round and this rule's take turns, so that load from other
    // processes falls on both; the first pair warms up.
    bench::Samples rule_seconds, fedavg_seconds;
    for (int r = 0; r <= reps; ++r) {
      auto base = time_round(**fedavg);
      if (!base.ok()) return bench.Fail(base.status());
      auto mine = time_round(**strategy);
      if (!mine.ok()) return bench.Fail(mine.status());
      if (r > 0) fedavg_seconds.Add(*base), rule_seconds.Add(*mine);
    }
    fmt::print("{:>12}: {:8.1f} ms a round, {:6.2f} GB/s of updates, {:6.2f}x FedAvg's {:.1f} ms\n", name,
               rule_seconds.median() * 1e3, round_bytes / rule_seconds.median() / 1e9,
               rule_seconds.median() / fedavg_seconds.median(), fedavg_seconds.median() * 1e3);
    if (std::string_view(name) == "median") {
      const std::string command = fmt::format(
          "OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 {} -c \"import numpy as np, time\n"
          "rng = np.random.default_rng(5)\nu = rng.standard_normal(({}, {}), dtype=np.float32) * 0.01\n"
          "best = []\nfor rep in range({}):\n  t = time.perf_counter()\n  m = np.median(u, axis=0)\n"
          "  best.append(time.perf_counter() - t)\nprint(sorted(best)[len(best) // 2])\"",
          python, sites, size, reps + 1);
      auto out = bench::CommandOutput(command);
      if (!out.ok()) {
        fmt::print("numpy: not run ({})\n", out.status().message());
      } else {
        const double numpy_seconds = std::stod(*out);
        fmt::print("{:>12}: {:8.1f} ms np.median(updates, axis=0), 1 thread\n", "numpy", numpy_seconds * 1e3);
        bench::PrintRatio("estuary median round / numpy median (speed)", numpy_seconds / rule_seconds.median());
      }
    }
  }
  return 0;
}
