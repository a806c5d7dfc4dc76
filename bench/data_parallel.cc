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
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <random>
#include <vector>

#include "bench/decoder.h"
#include "bench/harness.h"
#include "bench/rank_processes.h"
#include "comm/gloo_communicator.h"
#include "models/llama.h"
#include "models/model.h"
#include "models/optimizer.h"
#include "parallel/data_parallel.h"

namespace {

using namespace estuary;

constexpr int kSeq = 64;

// The CNN or the decoder, on synthetic inputs (timing does not depend on them).
struct Net {
  std::unique_ptr<models::Model> cnn;
  std::optional<models::Llama> llama;
  std::vector<float> x;
  std::vector<int32_t> y;
  bench::TokenBatch text;

  static Result<Net> Make(const std::string& name, int batch) {
    Net net;
    if (name == "cnn") {
      ESTUARY_ASSIGN_OR_RETURN(net.cnn, models::MakeModel("cnn"));
      net.cnn->Initialize(1);
      net.x.resize(size_t(batch) * net.cnn->input_size());
      net.y.resize(batch);
      std::mt19937 gen(5);
      for (auto& v : net.x) v = float(gen() % 256) / 255.0f;
      for (auto& v : net.y) v = int32_t(gen() % 10);
    } else {
      const models::LlamaConfig decoder{.vocab_size = 512, .hidden_size = 192, .intermediate_size = 512,
                                        .num_layers = 4, .num_heads = 6, .num_kv_heads = 3, .max_seq_len = kSeq};
      ESTUARY_ASSIGN_OR_RETURN(models::Llama llama, models::Llama::Create(decoder, batch));
      net.llama.emplace(std::move(llama));
      net.llama->Initialize(1);
      net.text = bench::RandomTokens(size_t(batch) * kSeq, decoder.vocab_size, 5);
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
      (void)llama->ForwardBackward(text.tokens.data(), text.targets.data(), n, kSeq, o);
    }
  }
};

// Medians over the timed steps, in ms.
struct Figures {
  double step_ms = 0, exposed_ms = 0, comm_ms = 0;
  size_t parameters = 0, buckets = 0;
};

// kind: -1 plain single process (no engine); else a ZeroStage.
Result<Figures> RunRank(const std::string& model, int kind, int n, int rank, int global_batch,
                        const bench::Repetitions& steps, const std::string& address) {
  openblas_set_num_threads(1);
  const int batch = (rank + 1) * global_batch / n - rank * global_batch / n;
  ESTUARY_ASSIGN_OR_RETURN(Net net, Net::Make(model, batch));
  models::AdamW opt({.lr = 1e-4f});
  Figures f;
  f.parameters = net.parameters().size();
  if (kind < 0) {
    auto plain_step = [&]() -> Status {
      net.Run(batch, {});
      opt.Step(net.parameters(), net.gradients());
      return Status::Ok();
    };
    ESTUARY_ASSIGN_OR_RETURN(const bench::Samples seconds, bench::Repeat(steps, plain_step));
    f.step_ms = seconds.median() * 1e3;
    return f;
  }
  ESTUARY_ASSIGN_OR_RETURN(auto communicator, comm::ConnectGloo({.address = address, .rank = rank, .size = n},
                                                                {.host = "127.0.0.1"}));
  const parallel::DataParallelOptions options{.stage = parallel::ZeroStage(kind), .broadcast_parameters = false};
  ESTUARY_ASSIGN_OR_RETURN(auto dp, parallel::DataParallel::Create(*communicator, net, options));
  f.buckets = dp->buckets().size();
  // One step after `backward`; the seconds it waited on collectives.
  auto step = [&](auto&& backward) -> Result<double> {
    backward();
    ESTUARY_ASSIGN_OR_RETURN(const auto r, dp->Step([&](auto slices) { opt.Step(slices); }));
    return r.wait_seconds;
  };
  auto real_step = [&] { return step([&] { net.Run(batch, dp->MicroBatch(double(batch) / global_batch, true)); }); };
  for (int i = 0; i < steps.warmup; ++i) ESTUARY_RETURN_IF_ERROR(real_step().status());
  bench::Samples exposed;
  auto timed_step = [&]() -> Status {
    ESTUARY_ASSIGN_OR_RETURN(const double wait, real_step());
    exposed.Add(wait);
    return Status::Ok();
  };
  ESTUARY_ASSIGN_OR_RETURN(const bench::Samples seconds,
                           bench::Repeat({.warmup = 0, .timed = steps.timed}, timed_step));
  f.step_ms = seconds.median() * 1e3;
  f.exposed_ms = exposed.median() * 1e3;
  if (kind == int(parallel::ZeroStage::kDdp)) {
    // The same collectives with nothing to hide behind, after one to warm up.
    auto comm_only = [&] { return step([&] { dp->MicroBatch(1.0, true).hooks->GradientsFinal(0); }); };
    ESTUARY_RETURN_IF_ERROR(comm_only().status());
    bench::Samples total;
    for (int i = 0; i < steps.timed; ++i) {
      ESTUARY_ASSIGN_OR_RETURN(const double wait, comm_only());
      total.Add(wait);
    }
    f.comm_ms = total.median() * 1e3;
  }
  return f;
}

// Runs n ranks as child processes; the figures reported are rank 0's.
Result<Figures> Launch(const std::string& model, int kind, int n, int global_batch, const bench::Repetitions& steps) {
  ESTUARY_ASSIGN_OR_RETURN(const std::vector<Figures> ranks,
                           bench::RunRanks<Figures>("data_parallel", n, [&](int rank, const std::string& address) {
                             return RunRank(model, kind, n, rank, global_batch, steps, address);
                           }));
  return ranks[0];
}

}  // namespace

int main(int argc, char** argv) {
  bench::Bench bench("data_parallel",
                     "DDP and ZeRO over Gloo on the CPU: step time for N = 1, 2 and the communication hidden");
  int cnn_batch = 32, decoder_batch = 8;
  bench::Repetitions steps{.warmup = 2, .timed = 10};
  std::string which = "all";
  bench.AddRepetitions(steps);
  bench.app().add_option("--model", which)->check(CLI::IsMember({"cnn", "decoder", "all"}));
  bench.app().add_option("--cnn-batch", cnn_batch, "global batch (images)");
  bench.app().add_option("--decoder-batch", decoder_batch, "global batch (sequences of 64 tokens)");
  if (auto code = bench.Parse(argc, argv)) return *code;

  fmt::print("{:<8} {:<6} {:>2} {:>10} {:>9} {:>12} {:>12} {:>8}\n", "model", "engine", "N", "step ms", "vs plain",
             "exposed ms", "comm ms", "hidden");
  for (const std::string model : {"cnn", "decoder"}) {
    if (which != "all" && which != model) continue;
    const int batch = model == "cnn" ? cnn_batch : decoder_batch;
    const Result<Figures> plain = Launch(model, -1, 1, batch, steps);
    if (!plain.ok()) return bench.Fail(plain.status());
    fmt::print("{:<8} {:<6} {:>2} {:>10.2f} {:>9} {:>12} {:>12} {:>8}   ({} parameters, global batch {})\n", model,
               "plain", 1, plain->step_ms, "1.00", "-", "-", "-", plain->parameters, batch);
    for (int kind = 0; kind < 4; ++kind) {
      for (int n : {1, 2}) {
        const Result<Figures> f = Launch(model, kind, n, batch, steps);
        if (!f.ok()) return bench.Fail(f.status());
        const bool ddp = kind == int(parallel::ZeroStage::kDdp);
        const std::string comm_ms = ddp ? fmt::format("{:.2f}", f->comm_ms) : "-";
        const std::string hidden = ddp && n > 1 && f->comm_ms > 0
                                       ? fmt::format("{:.0f}%", 100 * std::max(0.0, 1 - f->exposed_ms / f->comm_ms))
                                       : "-";
        fmt::print("{:<8} {:<6} {:>2} {:>10.2f} {:>9.2f} {:>12.2f} {:>12} {:>8}\n", model,
                   parallel::ZeroStageName(parallel::ZeroStage(kind)), n, f->step_ms, plain->step_ms / f->step_ms,
                   f->exposed_ms, comm_ms, hidden);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
