// What the three command-line tools share: one way to fail, one log-level
// flag, and flags that show their defaults in --help.
//
//   CLI::App app{"..."};
//   ShowDefaultsInHelp(app);              // before any option is added
//   AddLogLevelFlag(app, &log_level);     // an unknown level is refused at parse
//   if (auto exit = ParseCommandLine(app, argc, argv, "estuary-server")) return *exit;
//   ...
//   if (!s.ok()) return Fail("estuary-server", s);   // one line on stderr, exit 1
#pragma once

#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <optional>
#include <string>
#include <string_view>

#include "base/status.h"

namespace estuary {

// Every option added afterwards (to the app or a subcommand made after this
// call) shows its current value as its default in --help.
inline void ShowDefaultsInHelp(CLI::App& app) { app.option_defaults()->always_capture_default(); }

inline void AddLogLevelFlag(CLI::App& app, std::string* level) {
  app.add_option("--log-level", *level, "how much to log")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}));
}

// Logs to stderr under `name` at `level` (one AddLogLevelFlag accepted).
inline void StartLogging(const std::string& name, const std::string& level) {
  spdlog::set_default_logger(spdlog::stderr_color_mt(name));
  spdlog::set_level(spdlog::level::from_str(level));
}

inline int Fail(std::string_view program, const Status& status) {
  std::fprintf(stderr, "%.*s: %s\n", int(program.size()), program.data(), status.message().c_str());
  return 1;
}

// Parses the command line. --help prints the help and gives the exit code 0;
// a parse error is one line on stderr, "program: --epochs: Value x not in
// range... (see --help)", and gives CLI11's non-zero code. nullopt: go on.
inline std::optional<int> ParseCommandLine(CLI::App& app, int argc, char** argv, std::string_view program) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "%.*s: %s (see --help)\n", int(program.size()), program.data(), e.what());
    return e.get_exit_code();
  }
  return std::nullopt;
}

}  // namespace estuary
