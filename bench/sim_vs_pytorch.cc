// bench/sim_vs_pytorch: the flagship simulation against PyTorch on the same cores.
//
// Estuary's in-process simulator at one thread and at --threads N, against
// bench/torch_fedavg.py (Debian's python3-torch) run the ways a Python
// framework uses N cores: one process with torch's intra-op pool at 1 and at
// N threads, and N single-threaded worker processes that each train a share
// of a round's clients (one client per CPU, as Flower's simulation runs).
// Prints each run's wall time and accuracy, the CPU model, and the ratios per
// core (one thread a side) and on N cores (Estuary at N threads against the
// best PyTorch run on N); then the distance to the hardware: the workload's
// training FLOPs (TrainingFlopsPerExample x example passes) over Estuary's
// one-thread time, against a large OpenBLAS SGEMM on one core and libxsmm's kernel on
// operands in L1, both measured in the same run.
//   build/bench/sim_vs_pytorch [--data data/mnist] [--model mlp|cnn] [--rounds 20] [--threads 2]
#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "bench/harness.h"
#include "models/federated_model.h"
#include "models/small_gemm.h"
#include "simulations/runner.h"

using namespace estuary;

namespace {

// The model name /proc/cpuinfo gives the first CPU.
std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

// FLOPs of one example's training pass. The MLP: the usual 6 x parameters
// (forward, weight gradient, input gradient; a little high, since its first
// layer forms no input gradient). The CNN: a convolution's weights are used
// once per output pixel, so 6 x the forward's multiply-adds, less conv1's
// input gradient, which is not formed.
double TrainingFlopsPerExample(const std::string& model, uint64_t parameters) {
  if (model != "cnn") return 6.0 * double(parameters);
  const double conv1 = 32.0 * 25 * 28 * 28, conv2 = 64.0 * 800 * 14 * 14, fc = 3136.0 * 512 + 512.0 * 10;
  return 6.0 * (conv1 + conv2 + fc) - 2.0 * conv1;
}

// The item count of an IDX file's header.
Result<uint64_t> IdxCount(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  unsigned char header[8];
  if (!in.read(reinterpret_cast<char*>(header), 8)) return IoError("{}: cannot read its IDX header", file.string());
  return (uint64_t(header[4]) << 24) | (uint64_t(header[5]) << 16) | (uint64_t(header[6]) << 8) | header[7];
}

// fp32 GEMM GFLOP/s of one core: the best of a few 2048^3 SGEMMs.
double SgemmPeakGflops() {
  const int n = 2048;
  std::vector<float> a(size_t(n) * n, 0.5f), b(a.size(), 0.25f), c(a.size());
  openblas_set_num_threads(1);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    bench::Stopwatch watch;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    best = std::max(best, 2.0 * n * n * n / watch.Seconds() / 1e9);
  }
  return best;
}

// fp32 GFLOP/s of one core on libxsmm's JIT kernel for a 64^3 product whose
// operands stay in L1, the best of a few blocks of calls: the kernels the
// simulator's steps run, at their best. (On an AVX-512 CPU with OpenBLAS held
// to its AVX2 kernels, as OPENBLAS_CORETYPE=Haswell does, this is the higher
// of the two peaks.) 0 without libxsmm.
double XsmmPeakGflops() {
  if (!models::HaveXsmm()) return 0;
  const int n = 64, calls = 20000;
  std::vector<float> a(size_t(n) * n, 0.5f), b(a.size(), 0.25f), c(a.size());
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    bench::Stopwatch watch;
    for (int i = 0; i < calls; ++i) {
      models::SgemmOn(models::GemmEngine::kXsmm, false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 1.0f,
                      c.data(), n);
    }
    best = std::max(best, 2.0 * n * n * n * calls / watch.Seconds() / 1e9);
  }
  return best;
}

struct TorchRun {
  std::string label;
  double seconds = 0, accuracy = 0;
};

}  // namespace

int main(int argc, char** argv) {
  openblas_set_num_threads(1);
  bench::Bench bench("sim_vs_pytorch", "estuary in-process simulation vs PyTorch on the same cores");
  simulations::Scenario s;
  int threads = int(s.threads);
  std::string python = "/usr/bin/python3";
  CLI::App& app = bench.app();
  app.add_option("--data", s.data_dir, "directory with the MNIST IDX files (scripts/fetch-mnist)");
  v1::TaskConfig& task = s.task();
  app.add_option_function<std::string>("--model", [&](const std::string& v) { task.set_model(v); }, "mlp | cnn");
  app.add_option("--rounds", s.rounds, "federated rounds (fewer for a short run)");
  app.add_option("--clients", s.clients, "number of clients");
  app.add_option("--per-round", s.per_round, "clients per round: count (>= 1) or fraction (< 1)");
  app.add_option_function<uint32_t>("--epochs", [&](uint32_t v) { task.set_epochs(v); }, "local epochs per round");
  bench.AddThreads(threads, "cores both sides use: the simulator's client threads, PyTorch's threads or workers");
  bench.AddPython(python);
  if (auto code = bench.Parse(argc, argv)) return *code;

  auto run_estuary = [&](int n) -> Result<simulations::Report> {
    simulations::Scenario at = s;
    at.threads = uint32_t(n);
    return simulations::RunInproc(at, nullptr);
  };
  auto one = run_estuary(1);
  if (!one.ok()) return bench.Fail(one.status());
  auto many = run_estuary(threads);
  if (!many.ok()) return bench.Fail(many.status());

  const std::string base = fmt::format(
      "{} --data {} --model {} --rounds {} --clients {} --per-round {} --epochs {} --batch {} --lr {} --seed {}",
      bench::ScriptCommand(python, "torch_fedavg.py"), s.data_dir.string(), task.model(), s.rounds, s.clients,
      s.per_round, task.epochs(), task.batch_size(), task.learning_rate(), task.seed());
  auto run_torch = [&](const std::string& flags, const std::string& label) -> Result<TorchRun> {
    const std::string command = base + " " + flags;
    ESTUARY_ASSIGN_OR_RETURN(const std::string out, bench::CommandOutput(command));
    const auto json = nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
    if (!json.is_object() || !json.contains("seconds")) {
      return Internal("the PyTorch baseline printed no report: {}", command);
    }
    return TorchRun{fmt::format("pytorch {}, {}", json["torch"].get<std::string>(), label),
                    json["seconds"].get<double>(), json["final_accuracy"].get<double>()};
  };
  std::vector<TorchRun> torch;
  for (const auto& [flags, label] : std::vector<std::pair<std::string, std::string>>{
           {"--threads 1", "1 thread"},
           {fmt::format("--threads {}", threads), fmt::format("{} threads", threads)},
           {fmt::format("--workers {}", threads), fmt::format("{} worker processes", threads)}}) {
    auto r = run_torch(flags, label);
    if (!r.ok()) return bench.Fail(r.status());
    torch.push_back(*r);
  }
  const double torch_best = std::min(torch[1].seconds, torch[2].seconds);

  fmt::print("cpu: {}\n", CpuModel());
  fmt::print("scenario: {} clients, {} per round, {} rounds, {} epochs, batch {}, lr {}, model {}\n", s.clients,
             s.per_round, s.rounds, task.epochs(), task.batch_size(), task.learning_rate(), task.model());
  fmt::print("{:<40} {:>10} {:>10}\n", "", "seconds", "accuracy");
  fmt::print("{:<40} {:>10.2f} {:>10.4f}\n", "estuary-sim inproc, 1 thread", one->total_seconds, one->final_accuracy);
  fmt::print("{:<40} {:>10.2f} {:>10.4f}\n", fmt::format("estuary-sim inproc, {} threads", threads),
             many->total_seconds, many->final_accuracy);
  for (const TorchRun& t : torch) fmt::print("{:<40} {:>10.2f} {:>10.4f}\n", t.label, t.seconds, t.accuracy);

  // The distance to the hardware, from the workload's arithmetic.
  auto initial = models::InitialModel(task.model(), task.seed());
  if (!initial.ok()) return bench.Fail(initial.status());
  auto examples = IdxCount(s.data_dir / "train-labels-idx1-ubyte");
  if (!examples.ok()) return bench.Fail(examples.status());
  const double per_round = s.per_round >= 1 ? s.per_round : std::round(s.per_round * s.clients);
  const double passes = double(s.rounds) * per_round * task.epochs() * (double(*examples) / s.clients);
  const double per_example = TrainingFlopsPerExample(task.model(), initial->manifest.total_elements);
  const double gflop = per_example * passes / 1e9;
  const double peak = SgemmPeakGflops();
  const double achieved = gflop / one->total_seconds;
  fmt::print("work: {:.1f} GFLOP of training ({:.2f} MFLOP x {:.0f} example passes)\n", gflop, per_example / 1e6,
             passes);
  fmt::print("one core: estuary {:.1f} GFLOP/s against OpenBLAS SGEMM 2048^3 at {:.1f} GFLOP/s: {:.1f}% of it\n",
             achieved, peak, 100 * achieved / peak);
  if (const double xsmm = XsmmPeakGflops(); xsmm > 0) {
    fmt::print("one core: estuary {:.1f} GFLOP/s against libxsmm ({}) 64^3 in L1 at {:.1f} GFLOP/s: {:.1f}% of it\n",
               achieved, models::XsmmTarget(), xsmm, 100 * achieved / xsmm);
  }
  bench::PrintRatio("pytorch / estuary, wall time, per core (1 thread each)", torch[0].seconds / one->total_seconds);
  bench::PrintRatio(fmt::format("pytorch's best on {} cores / estuary on {} threads, wall time", threads, threads),
                    torch_best / many->total_seconds);
  return 0;
}
