// Ranks as real processes for the communicator tests: each rank is a child
// forked from the (still single-threaded) test process, runs a body that
// returns a Status, and exits 0 or prints its error and exits 1. The parent
// waits for all of them within a limit and kills any that outlive it, so a
// test that hangs still stops by itself.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "base/status.h"

// Inside a rank's body: fails the rank with an Internal status and a message.
#define CHECK_OR_RETURN(cond, ...)             \
  do {                                         \
    if (!(cond)) return Internal(__VA_ARGS__); \
  } while (0)

namespace estuary::comm::testing {

struct RankOutcome {
  int rank = 0;
  int exit_code = -1;  // when the child exited
  int signal = 0;      // when a signal ended it
  bool timed_out = false;
  bool ok() const { return exit_code == 0; }
  std::string Describe() const;
};

// Runs body(rank) for each of `ranks` in its own process; returns in the same order.
std::vector<RankOutcome> RunRanks(const std::vector<int>& ranks, const std::function<Status(int rank)>& body,
                                  std::chrono::seconds limit = std::chrono::seconds(120));
// All ranks 0 .. size-1.
std::vector<RankOutcome> RunRanks(int size, const std::function<Status(int rank)>& body,
                                  std::chrono::seconds limit = std::chrono::seconds(120));

// A tcp:// address on 127.0.0.1 with a port that was free a moment ago.
std::string FreeTcpAddress();
// A file:// address naming a new, empty directory under the test's temp dir.
std::string FreshDirAddress();

}  // namespace estuary::comm::testing
