// bench/sim_vs_pytorch: the flagship simulation against a plain PyTorch loop.
//
// Runs the scenario in this process with estuary's in-process simulator,
// then the same scenario with bench/torch_fedavg.py (Debian's python3-torch),
// and prints both wall times, both final accuracies and the speed ratio.
//   build/bench/sim_vs_pytorch [--data data/mnist] [--model mlp|cnn] [--rounds 20]
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>

#include "simulations/runner.h"

extern "C" void openblas_set_num_threads(int);

int main(int argc, char** argv) {
  using namespace estuary;
  openblas_set_num_threads(1);
  CLI::App app{"estuary in-process simulation vs a PyTorch loop"};
  estuary::simulations::Scenario s;
  std::string python = "/usr/bin/python3";
  app.add_option("--data", s.data_dir);
  v1::TaskConfig& task = s.task();
  app.add_option_function<std::string>("--model", [&](const std::string& v) { task.set_model(v); });
  app.add_option("--rounds", s.rounds);
  app.add_option("--clients", s.clients);
  app.add_option("--per-round", s.per_round);
  app.add_option_function<uint32_t>("--epochs", [&](uint32_t v) { task.set_epochs(v); });
  app.add_option("--threads", s.threads);
  app.add_option("--python", python);
  CLI11_PARSE(app, argc, argv);

  auto report = estuary::simulations::RunInproc(s, nullptr);
  if (!report.ok()) {
    std::fprintf(stderr, "sim_vs_pytorch: %s\n", report.status().ToString().c_str());
    return 1;
  }
  const std::string command =
      fmt::format("{} {}/bench/torch_fedavg.py --data {} --model {} --rounds {} --clients {} --per-round {} "
                  "--epochs {} --batch {} --lr {} --seed {}",
                  python, ESTUARY_SOURCE_DIR, s.data_dir.string(), task.model(), s.rounds, s.clients, s.per_round,
                  task.epochs(), task.batch_size(), task.learning_rate(), task.seed());
  FILE* pipe = popen(command.c_str(), "r");
  std::string out;
  char buffer[4096];
  size_t n;
  while (pipe && (n = fread(buffer, 1, sizeof buffer, pipe)) > 0) out.append(buffer, n);
  if (!pipe || pclose(pipe) != 0) {
    std::fprintf(stderr, "sim_vs_pytorch: the PyTorch baseline failed: %s\n", command.c_str());
    return 1;
  }
  const auto torch = nlohmann::json::parse(out);
  const double torch_seconds = torch["seconds"].get<double>();
  fmt::print("scenario: {} clients, {} per round, {} rounds, {} epochs, batch {}, lr {}, model {}\n", s.clients,
             s.per_round, s.rounds, task.epochs(), task.batch_size(), task.learning_rate(), task.model());
  fmt::print("{:<28} {:>10} {:>10}\n", "", "seconds", "accuracy");
  fmt::print("{:<28} {:>10.2f} {:>10.4f}\n", "estuary-sim inproc", report->total_seconds, report->final_accuracy);
  fmt::print("{:<28} {:>10.2f} {:>10.4f}\n",
             fmt::format("pytorch {} ({} threads)", torch["torch"].get<std::string>(), torch["threads"].get<int>()),
             torch_seconds, torch["final_accuracy"].get<double>());
  fmt::print("speedup: {:.1f}x\n", torch_seconds / report->total_seconds);
  return 0;
}
