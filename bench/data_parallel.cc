// bench/data_parallel: a training step of the MNIST CNN and a small decoder
// with N = 1 and 2 Gloo ranks (real processes on 127.0.0.1), DDP and ZeRO-1/2/3,
// against plain single-process training of the same global batch in the same
// run; and, for DDP, how much of the gradient all-reduce backward hides:
// exposed = time the training thread waits on collectives in a real step;
// total = the same buckets' all-reduces with no backward to hide behind
// (every bucket launched at once, then waited for); hidden = 1 - exposed/total.
// Figures are medians over the timed steps.
// Every process uses one BLAS thread, so N ranks use N cores.
//   build/bench/data_parallel [--steps 10] [--model cnn|decoder|all] [--cnn-batch 32] [--decoder-batch 8]
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <random>
#include <vector>

#include "parallel/data_parallel.h"
#include "bench/rank_processes.h"
#include "comm/gloo_communicator.h"
#include "models/llama.h"
#include "models/model.h"
#include "models/optimizer.h"

extern "C" void openblas_set_num_threads(int);

namespace {

using namespace estuary;
using Clock = std::chrono::steady_clock;

constexpr int kSeq = 64;

models::LlamaConfig Decoder() {
  models::LlamaConfig c;
  c.vocab_size = 512;
  c.hidden_size = 192;
  c.intermediate_size = 512;
  c.num_layers = 4;
  c.num_heads = 6;
  c.num_kv_heads = 3;
  c.max_seq_len = kSeq;
  return c;
}

// The CNN or the decoder, on synthetic inputs (timing does not depend on them).
struct Net {
  std::unique_ptr<models::Model> cnn;
  std::optional<models::Llama> llama;
  std::vector<float> x;
  std::vector<int32_t> y, tokens, targets;

  static Net Make(const std::string& name, int batch) {
    Net net;
    std::mt19937 gen(5);
    if (name == "cnn") {
      net.cnn = std::move(models::MakeModel("cnn")).value();
      net.cnn->Initialize(1);
      net.x.resize(size_t(batch) * net.cnn->input_size());
      net.y.resize(batch);
      for (auto& v : net.x) v = float(gen() % 256) / 255.0f;
      for (auto& v : net.y) v = int32_t(gen() % 10);
    } else {
      net.llama.emplace(std::move(models::Llama::Create(Decoder(), batch)).value());
      net.llama->Initialize(1);
      net.tokens.resize(size_t(batch) * kSeq);
      net.targets.resize(net.tokens.size());
      for (auto& t : net.tokens) t = int32_t(gen() % 512);
      for (auto& t : net.targets) t = int32_t(gen() % 512);
    }
    return net;
  }
  std::span<float> parameters() { return cnn ? cnn->parameters() : llama->parameters(); }
  std::span<float> gradients() { return cnn ? cnn->gradients() : llama->gradients(); }
  std::vector<models::ParameterUnit> units() const { return cnn ? cnn->units() : llama->units(); }
  void Run(int n, const models::BackwardOptions& o) {
    if (cnn) {
      cnn->ForwardBackward(x.data(), y.data(), n, o);
    } else {
      (void)llama->ForwardBackward(tokens.data(), targets.data(), n, kSeq, o);
    }
  }
};

// Medians over the timed steps: the machine is shared, and a median shrugs off
// a step that lost its core for a while.
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Figures {
  double step_ms = 0, exposed_ms = 0, comm_ms = 0;
  size_t parameters = 0, buckets = 0;
};

// kind: -1 plain single process (no engine); else a ZeroStage.
Figures RunRank(const std::string& model, int kind, int n, int rank, int global_batch, int steps,
                const std::string& address) {
  openblas_set_num_threads(1);
  const int batch = (rank + 1) * global_batch / n - rank * global_batch / n;
  Net net = Net::Make(model, batch);
  models::AdamW opt({.lr = 1e-4f});
  Figures f;
  f.parameters = net.parameters().size();
  std::vector<double> step_ms, exposed_ms, comm_ms;
  if (kind < 0) {
    for (int s = -2; s < steps; ++s) {  // two warm-up steps
      const auto start = Clock::now();
      net.Run(batch, {});
      opt.Step(net.parameters(), net.gradients());
      if (s >= 0) step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    }
    f.step_ms = Median(step_ms);
    return f;
  }
  auto comm = comm::ConnectGloo({.address = address, .rank = rank, .size = n}, {.host = "127.0.0.1"});
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, comm.status().ToString().c_str());
    std::exit(1);
  }
  auto dp = parallel::DataParallel::Create(**comm, net, {.stage = parallel::ZeroStage(kind), .broadcast_parameters = false});
  if (!dp.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, dp.status().ToString().c_str());
    std::exit(1);
  }
  f.buckets = (*dp)->buckets().size();
  auto step = [&](auto&& backward) {
    backward();
    auto r = (*dp)->Step([&](auto slices) { opt.Step(slices); });
    if (!r.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, r.status().ToString().c_str());
      std::exit(1);
    }
    return r->wait_seconds * 1e3;
  };
  for (int s = -2; s < steps; ++s) {
    const auto start = Clock::now();
    const double exposed = step([&] { net.Run(batch, (*dp)->MicroBatch(double(batch) / global_batch, true)); });
    if (s >= 0) {
      step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
      exposed_ms.push_back(exposed);
    }
  }
  if (kind == int(parallel::ZeroStage::kDdp)) {
    // The same collectives with nothing to hide behind.
    for (int s = -1; s < steps; ++s) {
      const double total = step([&] { (*dp)->MicroBatch(1.0, true).hooks->GradientsFinal(0); });
      if (s >= 0) comm_ms.push_back(total);
    }
  }
  f.step_ms = Median(step_ms);
  f.exposed_ms = Median(exposed_ms);
  f.comm_ms = Median(comm_ms);
  return f;
}

// Runs n ranks as child processes; the figures reported are rank 0's.
Figures Launch(const std::string& model, int kind, int n, int global_batch, int steps) {
  return bench::RunRanks<Figures>("data_parallel", n, [&](int rank, const std::string& address) {
    return RunRank(model, kind, n, rank, global_batch, steps, address);
  })[0];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"DDP and ZeRO over Gloo on the CPU: step time for N = 1, 2 and the communication hidden"};
  int steps = 10, cnn_batch = 32, decoder_batch = 8;
  std::string which = "all";
  app.add_option("--steps", steps);
  app.add_option("--model", which)->check(CLI::IsMember({"cnn", "decoder", "all"}));
  app.add_option("--cnn-batch", cnn_batch, "global batch (images)");
  app.add_option("--decoder-batch", decoder_batch, "global batch (sequences of 64 tokens)");
  CLI11_PARSE(app, argc, argv);

  std::printf("%-8s %-6s %2s %10s %9s %12s %12s %8s\n", "model", "engine", "N", "step ms", "vs plain", "exposed ms",
              "comm ms", "hidden");
  for (const std::string model : {"cnn", "decoder"}) {
    if (which != "all" && which != model) continue;
    const int batch = model == "cnn" ? cnn_batch : decoder_batch;
    const Figures plain = Launch(model, -1, 1, batch, steps);
    std::printf("%-8s %-6s %2d %10.2f %9s %12s %12s %8s   (%zu parameters, global batch %d)\n", model.c_str(),
                "plain", 1, plain.step_ms, "1.00", "-", "-", "-", plain.parameters, batch);
    for (int kind = 0; kind < 4; ++kind) {
      for (int n : {1, 2}) {
        const Figures f = Launch(model, kind, n, batch, steps);
        const std::string hidden =
            kind == 0 && n > 1 && f.comm_ms > 0 ? fmt::format("{:.0f}%", 100 * std::max(0.0, 1 - f.exposed_ms / f.comm_ms)) : "-";
        std::printf("%-8s %-6s %2d %10.2f %9.2f %12.2f %12s %8s\n", model.c_str(), std::string(parallel::ZeroStageName(parallel::ZeroStage(kind))).c_str(), n, f.step_ms,
                    plain.step_ms / f.step_ms, f.exposed_ms, kind == 0 ? fmt::format("{:.2f}", f.comm_ms).c_str() : "-",
                    hidden.c_str());
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
