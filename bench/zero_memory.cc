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
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "parallel/data_parallel.h"
#include "bench/rank_processes.h"
#include "comm/gloo_communicator.h"
#include "models/language_model.h"
#include "models/llama.h"
#include "models/optimizer.h"

extern "C" void openblas_set_num_threads(int);

namespace {

using namespace estuary;
using Clock = std::chrono::steady_clock;

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

[[noreturn]] void Die(int rank, const Status& status) {
  std::fprintf(stderr, "rank %d: %s\n", rank, status.ToString().c_str());
  std::exit(1);
}

RankFigures RunRank(parallel::ZeroStage stage, int n, int rank, int steps, int seq, const std::string& address) {
  openblas_set_num_threads(1);
  auto config = models::LlamaPreset("llama-124m");
  if (!config.ok()) Die(rank, config.status());
  auto model = models::Llama::Create(*config, 1);
  if (!model.ok()) Die(rank, model.status());
  model->Initialize(1);
  std::mt19937 gen(11 + rank);
  std::vector<int32_t> tokens(seq), targets(seq);
  for (auto& t : tokens) t = int32_t(gen() % config->vocab_size);
  for (auto& t : targets) t = int32_t(gen() % config->vocab_size);

  auto comm = comm::ConnectGloo({.address = address, .rank = rank, .size = n}, {.host = "127.0.0.1"});
  if (!comm.ok()) Die(rank, comm.status());
  // Every rank initialised the same weights: no broadcast needed.
  auto dp = parallel::DataParallel::Create(**comm, *model, {.stage = stage, .broadcast_parameters = false});
  if (!dp.ok()) Die(rank, dp.status());
  models::AdamW opt({.lr = 1e-4f});

  const size_t peak_setup = StatusBytes("VmHWM");
  ResetPeak();
  const auto start = Clock::now();
  for (int s = 0; s < steps; ++s) {
    auto loss = model->ForwardBackward(tokens.data(), targets.data(), 1, seq, (*dp)->MicroBatch(1.0 / n, true));
    if (!loss.ok()) Die(rank, loss.status());
    auto r = (*dp)->Step([&](auto slices) { opt.Step(slices); });
    if (!r.ok()) Die(rank, r.status());
  }
  RankFigures f;
  f.rank = rank;
  f.step_seconds = std::chrono::duration<double>(Clock::now() - start).count() / steps;
  f.parameter_bytes = model->parameters().size_bytes();
  auto m = (*dp)->Memory((opt.first_moment().size() + opt.second_moment().size()) * sizeof(float));
  if (!m.ok()) Die(rank, m.status());
  f.engine = *m;
  auto arena = models::ResidentBytes(model->activation_arena());
  if (!arena.ok()) Die(rank, arena.status());
  f.arena = *arena;
  f.peak_steps = StatusBytes("VmHWM");
  f.peak_process = std::max(peak_setup, f.peak_steps);
  return f;
}

}  // namespace

namespace {

// Runs n ranks as child processes and collects every rank's figures.
std::vector<RankFigures> Launch(parallel::ZeroStage stage, int n, int steps, int seq) {
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
  CLI::App app{"Memory per rank for DDP and ZeRO-1/2/3 on llama-124m over Gloo, against ZeRO's formula"};
  std::vector<int> ranks = {1, 2, 4}, stages = {0, 1, 2, 3};
  int steps = 2, seq = 64;
  app.add_option("--ranks", ranks)->delimiter(',');
  app.add_option("--stages", stages, "0: DDP, 1-3: ZeRO stage")->delimiter(',')->check(CLI::Range(0, 3));
  app.add_option("--steps", steps)->check(CLI::PositiveNumber);
  app.add_option("--seq", seq, "tokens per rank per step (batch 1)")->check(CLI::Range(1, 1024));
  CLI11_PARSE(app, argc, argv);

  std::printf("MiB per rank (the largest rank of each column); engine = params + grads + shard + optimizer + staging\n");
  std::printf("%-6s %2s %8s %8s %8s %9s %7s %8s %8s %6s %7s %11s %13s %7s\n", "stage", "N", "params", "grads",
              "shard", "optimizer", "staging", "engine", "formula", "ratio", "arena", "peak steps", "peak process",
              "step s");
  for (int n : ranks) {
    for (int k : stages) {
      const auto stage = parallel::ZeroStage(k);
      const std::vector<RankFigures> figures = Launch(stage, n, steps, seq);
      auto max = [&](auto field) {
        double m = 0;
        for (const RankFigures& f : figures) m = std::max(m, double(field(f)));
        return m;
      };
      const double engine = max([](const RankFigures& f) { return f.engine.total(); });
      const double formula = Formula(stage, n, double(figures[0].parameter_bytes));
      std::printf("%-6s %2d %8s %8s %8s %9s %7s %8s %8s %6.3f %7s %11s %13s %7.1f\n",
                  std::string(parallel::ZeroStageName(stage)).c_str(), n,
                  MiB(max([](const RankFigures& f) { return f.engine.parameters; })).c_str(),
                  MiB(max([](const RankFigures& f) { return f.engine.gradients; })).c_str(),
                  MiB(max([](const RankFigures& f) { return f.engine.shard_parameters + f.engine.shard_gradients; }))
                      .c_str(),
                  MiB(max([](const RankFigures& f) { return f.engine.optimizer_state; })).c_str(),
                  MiB(max([](const RankFigures& f) { return f.engine.staging; })).c_str(), MiB(engine).c_str(),
                  MiB(formula).c_str(), engine / formula, MiB(max([](const RankFigures& f) { return f.arena; })).c_str(),
                  MiB(max([](const RankFigures& f) { return f.peak_steps; })).c_str(),
                  MiB(max([](const RankFigures& f) { return f.peak_process; })).c_str(),
                  max([](const RankFigures& f) { return f.step_seconds; }));
      std::fflush(stdout);
    }
  }
  return 0;
}
