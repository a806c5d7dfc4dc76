// Timestamps as the logs, the operator's views and error messages print them:
// ISO 8601 in UTC, to the second ("2026-11-23T11:41:50Z").
#pragma once

#include <fmt/chrono.h>

#include <chrono>
#include <ctime>
#include <string>

namespace estuary {

inline std::string Utc(std::chrono::system_clock::time_point t) {
  return fmt::format("{:%Y-%m-%dT%H:%M:%S}Z", fmt::gmtime(std::chrono::system_clock::to_time_t(t)));
}

}  // namespace estuary
