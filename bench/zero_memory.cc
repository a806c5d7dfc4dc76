// bench/zero_memory: memory per rank for DDP and ZeRO-1/2/3 on llama-124m
// (models/language_model.cc's preset: 124M parameters, tied), with N Gloo
// ranks — real processes on 127.0.0.1 — and AdamW, against ZeRO's formula.
//
// Each rank builds the model with an arena for batch 1, runs `--steps` steps
// of 1 × `--seq` tokens (64 by default: a step takes seconds, and the
// engine's state does not depend on the sequence; the activations do, which
// is why the arena is listed on its own), then reports
// - the engine's Memory(): resident bytes of the flat parameter and gradient
//   buffers, the shard buffers, AdamW's two moments as allocated, staging;
// - the activation arena's resident bytes;
// - peak resident memory (VmHWM) over the steps only (the mark is reset
//   after setup through /proc/self/clear_refs) and over the whole process
//   (setup included: Initialize writes every parameter on every rank before
//   ZeRO-3 releases them).
// Formula (P = parameter bytes, G = P, O = AdamW's moments = 2P):
//   DDP P+G+O;  ZeRO-1 P+G+O/N;  ZeRO-2 P+G/N+O/N;  ZeRO-3 (P+G+O)/N.
// Configurations run one after another; each line is the largest rank.
//   build/bench/zero_memory [--ranks 1,2,4] [--stages 0,1,2,3] [--steps 2] [--seq 64]
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "bench/decoder.h"
#include "bench/harness.h"
#include "bench/rank_processes.h"
#include "comm/gloo_communicator.h"
#include "models/language_model.h"
#include "models/llama.h"
#include "models/optimizer.h"
#include "parallel/data_parallel.h"

namespace {

using namespace estuary;

// What a rank sends back: a plain struct through a pipe (smaller than
// PIPE_BUF, so the ranks' writes do not interleave).
struct RankFigures {
  int rank = 0;
  size_t parameter_bytes = 0;  // P
  parallel::MemoryUse engine;
  size_t arena = 0;            // resident bytes of the activation arena
  size_t peak_steps = 0, peak_process = 0;
  double step_seconds = 0;
};

// A field of /proc/self/status, in bytes.
size_t StatusBytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.starts_with(field + ":")) return std::stoull(line.substr(field.size() + 1)) * 1024;
  }
  return 0;
}

// Resets VmHWM to the current resident size (Linux >= 4.0), so the next
// reading is the peak from here on.
void ResetPeak() { std::ofstream("/proc/self/clear_refs") << "5"; }

Result<RankFigures> RunRank(parallel::ZeroStage stage, int n, int rank, int steps, int seq,
                            const std::string& address) {
  openblas_set_num_threads(1);
  ESTUARY_ASSIGN_OR_RETURN(const models::LlamaConfig config, models::LlamaPreset("llama-124m"));
  ESTUARY_ASSIGN_OR_RETURN(models::Llama model, models::Llama::Create(config, 1));
  model.Initialize(1);
  const bench::TokenBatch data = bench::RandomTokens(seq, config.vocab_size, 11 + rank);

  ESTUARY_ASSIGN_OR_RETURN(auto communicator, comm::ConnectGloo({.address = address, .rank = rank, .size = n},
                                                                {.host = "127.0.0.1"}));
  // Every rank initialised the same weights: no broadcast needed.
  const parallel::DataParallelOptions options{.stage = stage, .broadcast_parameters = false};
  ESTUARY_ASSIGN_OR_RETURN(auto dp, parallel::DataParallel::Create(*communicator, model, options));
  models::AdamW opt({.lr = 1e-4f});

  const size_t peak_setup = StatusBytes("VmHWM");
  ResetPeak();
  // No warm-up: the peak over the steps is the figure, and the first step's
  // page faults belong in it.
  auto step = [&]() -> Status {
    ESTUARY_RETURN_IF_ERROR(
        model.ForwardBackward(data.tokens.data(), data.targets.data(), 1, seq, dp->MicroBatch(1.0 / n, true))
            .status());
    return dp->Step([&](auto slices) { opt.Step(slices); }).status();
  };
  RankFigures f;
  f.rank = rank;
  ESTUARY_ASSIGN_OR_RETURN(f.step_seconds, bench::SecondsPerCall(steps, step));
  f.parameter_bytes = model.parameters().size_bytes();
  const size_t optimizer_bytes = (opt.first_moment().size() + opt.second_moment().size()) * sizeof(float);
  ESTUARY_ASSIGN_OR_RETURN(f.engine, dp->Memory(optimizer_bytes));
  ESTUARY_ASSIGN_OR_RETURN(f.arena, models::ResidentBytes(model.activation_arena()));
  f.peak_steps = StatusBytes("VmHWM");
  f.peak_process = std::max(peak_setup, f.peak_steps);
  return f;
}

// Runs n ranks as child processes and collects every rank's figures.
Result<std::vector<RankFigures>> Launch(parallel::ZeroStage stage, int n, int steps, int seq) {
  return bench::RunRanks<RankFigures>("zero_memory", n, [&](int rank, const std::string& address) {
    return RunRank(stage, n, rank, steps, seq, address);
  });
}

double Formula(parallel::ZeroStage stage, int n, double P) {
  const double G = P, O = 2 * P;
  switch (stage) {
    case parallel::ZeroStage::kDdp: return P + G + O;
    case parallel::ZeroStage::kZero1: return P + G + O / n;
    case parallel::ZeroStage::kZero2: return P + G / n + O / n;
    case parallel::ZeroStage::kZero3: return (P + G + O) / n;
  }
  return 0;
}

std::string MiB(double bytes) { return fmt::format("{:.1f}", bytes / (1 << 20)); }

}  // namespace

int main(int argc, char** argv) {
  bench::Bench bench("zero_memory",
                     "Memory per rank for DDP and ZeRO-1/2/3 on llama-124m over Gloo, against ZeRO's formula");
  std::vector<int> ranks = {1, 2, 4}, stages = {0, 1, 2, 3};
  int steps = 2, seq = 64;
  bench.app().add_option("--ranks", ranks)->delimiter(',');
  bench.app().add_option("--stages", stages, "0: DDP, 1-3: ZeRO stage")->delimiter(',')->check(CLI::Range(0, 3));
  bench.app().add_option("--steps", steps, "all timed, no warm-up")->check(bench::AtLeast(1));
  bench.app().add_option("--seq", seq, "tokens per rank per step (batch 1)")->check(CLI::Range(1, 1024));
  if (auto code = bench.Parse(argc, argv)) return *code;

  fmt::print("MiB per rank (the largest rank of each column); engine = params + grads + shard + optimizer + staging\n");
  fmt::print("{:<6} {:>2} {:>8} {:>8} {:>8} {:>9} {:>7} {:>8} {:>8} {:>6} {:>7} {:>11} {:>13} {:>7}\n", "stage", "N",
             "params", "grads", "shard", "optimizer", "staging", "engine", "formula", "ratio", "arena", "peak steps",
             "peak process", "step s");
  for (int n : ranks) {
    for (int k : stages) {
      const auto stage = parallel::ZeroStage(k);
      const Result<std::vector<RankFigures>> figures = Launch(stage, n, steps, seq);
      if (!figures.ok()) return bench.Fail(figures.status());
      auto max = [&](auto field) {
        double m = 0;
        for (const RankFigures& f : *figures) m = std::max(m, double(field(f)));
        return m;
      };
      const double engine = max([](const RankFigures& f) { return f.engine.total(); });
      const double formula = Formula(stage, n, double((*figures)[0].parameter_bytes));
      fmt::print("{:<6} {:>2} {:>8} {:>8} {:>8} {:>9} {:>7} {:>8} {:>8} {:>6.3f} {:>7} {:>11} {:>13} {:>7.1f}\n",
                 parallel::ZeroStageName(stage), n, MiB(max([](const RankFigures& f) { return f.engine.parameters; })),
                 MiB(max([](const RankFigures& f) { return f.engine.gradients; })),
                 MiB(max([](const RankFigures& f) { return f.engine.shard_parameters + f.engine.shard_gradients; })),
                 MiB(max([](const RankFigures& f) { return f.engine.optimizer_state; })),
                 MiB(max([](const RankFigures& f) { return f.engine.staging; })), MiB(engine), MiB(formula),
                 engine / formula, MiB(max([](const RankFigures& f) { return f.arena; })),
                 MiB(max([](const RankFigures& f) { return f.peak_steps; })),
                 MiB(max([](const RankFigures& f) { return f.peak_process; })),
                 max([](const RankFigures& f) { return f.step_seconds; }));
      std::fflush(stdout);
    }
  }
  return 0;
}
