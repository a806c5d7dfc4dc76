// TOML config files for the command-line tools.
//
// A config file holds the same keys as the tool's long flags (without the
// dashes, '_' or '-': `rounds = 20`, `listen = "127.0.0.1:7443"`, `exit_when_done = true`).
// Flags given on the command line win over the file. Any problem -- the file
// is missing, the TOML is malformed, a key is unknown or has the wrong type --
// is one line naming the file, and the line when TOML knows it.
#pragma once

#include <CLI/CLI.hpp>
#include <toml++/toml.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include "base/status.h"

namespace estuary {

inline Status ApplyConfigFile(CLI::App& app, const std::filesystem::path& path) {
  toml::table table;
  try {
    table = toml::parse_file(path.string());
  } catch (const toml::parse_error& e) {
    const auto& where = e.source().begin;
    return InvalidArgument("config: {}:{}:{}: {}", path.string(), where.line, where.column, e.description());
  }
  for (const auto& [key, node] : table) {
    const std::string name(key.str());
    std::string flag = "--" + name;
    std::replace(flag.begin(), flag.end(), '_', '-');  // clients_per_round -> --clients-per-round
    CLI::Option* option = app.get_option_no_throw(flag);
    if (option == nullptr || name == "config") {
      return InvalidArgument("config: {}: unknown key '{}'", path.string(), name);
    }
    if (option->count() > 0) continue;  // given on the command line
    // A flag takes true or false only: CLI11 would read any other string as
    // a number, and throw std::invalid_argument out of its callback.
    const bool is_flag = option->get_expected_max() == 0;
    if (is_flag && !node.is_boolean()) {
      return InvalidArgument("config: {}: key '{}' is a flag; it must be true or false", path.string(), name);
    }
    std::string value;
    if (auto s = node.value_exact<std::string>()) value = *s;
    else if (auto i = node.value_exact<int64_t>()) value = std::to_string(*i);
    else if (auto d = node.value_exact<double>()) value = fmt::format("{}", *d);
    else if (auto b = node.value_exact<bool>()) value = *b ? "true" : "false";
    else return InvalidArgument("config: {}: key '{}' must be a string, number or boolean", path.string(), name);
    try {
      option->add_result(value);
      option->run_callback();
    } catch (const std::exception& e) {  // CLI::Error, and what a conversion inside CLI11 throws
      return InvalidArgument("config: {}: key '{}' = {}: {}", path.string(), name, value, e.what());
    }
  }
  return Status::Ok();
}

}  // namespace estuary
