// bench/sim_vs_pytorch: the flagship simulation against a plain PyTorch loop.
//
// Runs the scenario in this process with estuary's in-process simulator,
// then the same scenario with bench/torch_fedavg.py (Debian's python3-torch),
// and prints both wall times, both final accuracies and the speed ratio.
//   build/bench/sim_vs_pytorch [--data data/mnist] [--model mlp|cnn] [--rounds 20]
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench/harness.h"
#include "simulations/runner.h"

using namespace estuary;

int main(int argc, char** argv) {
  openblas_set_num_threads(1);
  bench::Bench bench("sim_vs_pytorch", "estuary in-process simulation vs a PyTorch loop");
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
  bench.AddThreads(threads, "the simulator's client threads (PyTorch picks its own)");
  bench.AddPython(python);
  if (auto code = bench.Parse(argc, argv)) return *code;
  s.threads = uint32_t(threads);

  auto report = simulations::RunInproc(s, nullptr);
  if (!report.ok()) return bench.Fail(report.status());
  const std::string command = fmt::format(
      "{} --data {} --model {} --rounds {} --clients {} --per-round {} --epochs {} --batch {} --lr {} --seed {}",
      bench::ScriptCommand(python, "torch_fedavg.py"), s.data_dir.string(), task.model(), s.rounds, s.clients,
      s.per_round, task.epochs(), task.batch_size(), task.learning_rate(), task.seed());
  auto out = bench::CommandOutput(command);
  if (!out.ok()) return bench.Fail(out.status());
  const auto torch = nlohmann::json::parse(*out, nullptr, /*allow_exceptions=*/false);
  if (!torch.is_object() || !torch.contains("seconds")) {
    return bench.Fail(Internal("the PyTorch baseline printed no report: {}", command));
  }
  const double torch_seconds = torch["seconds"].get<double>();
  fmt::print("scenario: {} clients, {} per round, {} rounds, {} epochs, batch {}, lr {}, model {}\n", s.clients,
             s.per_round, s.rounds, task.epochs(), task.batch_size(), task.learning_rate(), task.model());
  fmt::print("{:<28} {:>10} {:>10}\n", "", "seconds", "accuracy");
  fmt::print("{:<28} {:>10.2f} {:>10.4f}\n", "estuary-sim inproc", report->total_seconds, report->final_accuracy);
  fmt::print("{:<28} {:>10.2f} {:>10.4f}\n",
             fmt::format("pytorch {} ({} threads)", torch["torch"].get<std::string>(), torch["threads"].get<int>()),
             torch_seconds, torch["final_accuracy"].get<double>());
  bench::PrintRatio("pytorch / estuary, wall time", torch_seconds / report->total_seconds);
  return 0;
}
