// A TOML config file applied to a command line (base/config_file.h's
// ApplyConfigFile) that holds the federation's flags
// (aggregation::AddFederationFlags) and options of each type the programs
// take; a config accepted then goes through aggregation::CheckFederation, as
// the server's does. One flag is also given on the command line, which the
// file must not override.
#include <CLI/CLI.hpp>

#include "aggregation/federation.h"
#include "aggregation/federation_flags.h"
#include "base/config_file.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace estuary;
  const auto path = fuzz::WriteScratch("config.toml", {reinterpret_cast<const char*>(data), size});

  CLI::App app("estuary-fuzz");
  v1::FederationConfig federation = aggregation::DefaultFederation();
  aggregation::AddFederationFlags(app, &federation);
  std::string config, listen = "127.0.0.1:7443", db = "estuary.db";
  uint64_t rounds = 20;
  uint32_t min_clients = 10;
  double clients_per_round = 10, deadline = 600;
  int zero = 0;
  bool exit_when_done = false;
  std::vector<int> gpus;
  app.add_option("--config", config, "TOML file");
  app.add_option("--listen", listen, "HOST:PORT");
  app.add_option("--db", db, "round log");
  app.add_option("--rounds", rounds, "rounds")->check(CLI::PositiveNumber);
  app.add_option("--min-clients", min_clients, "clients");
  app.add_option("--clients-per-round", clients_per_round, "count or fraction");
  app.add_option("--round-deadline", deadline, "seconds")->check(CLI::Range(0.001, 86400.0));
  app.add_option("--zero", zero, "ZeRO stage")->check(CLI::IsMember({0, 1, 2, 3}));
  app.add_option("--gpus", gpus, "GPU indices")->delimiter(',');
  app.add_flag("--exit-when-done", exit_when_done, "stop after the last round");
  try {
    const char* argv[] = {"estuary-fuzz", "--seed", "7"};
    app.parse(3, argv);
  } catch (const CLI::Error& e) {
    FUZZ_CHECK(false, "the command line: %s", e.what());
  }

  Status applied = ApplyConfigFile(app, path);
  if (!applied.ok()) {
    fuzz::CheckError(applied);
    return 0;
  }
  FUZZ_CHECK(federation.task().seed() == 7, "the file overrode --seed given on the command line");
  Status checked = aggregation::CheckFederation(federation);
  if (!checked.ok()) fuzz::CheckError(checked);
  return 0;
}
