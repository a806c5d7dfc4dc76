// LocalDeadline: the cap on a round's local training time
// (TaskConfig::max_local_seconds), decided the same way on every rank.
//
// Rank 0's clock alone decides; with more than one rank each Reached() is a
// one-byte broadcast from rank 0, so every rank stops after the same step
// and a multi-rank site still trains what its ranks agree on. Call Reached()
// after each optimizer step, on every rank, the same number of times; the
// first step always runs, so a capped round is never empty. With no cap it
// never talks to the other ranks.
//
//   LocalDeadline deadline(task.max_local_seconds, comm);
//   while (schedule.Next()) { Step(); if (deadline.Reached()) break; }
#pragma once

#include <chrono>
#include <functional>

#include "base/status.h"
#include "comm/communicator.h"

namespace estuary::client {

class LocalDeadline {
 public:
  using Clock = std::chrono::steady_clock;

  // Starts counting now. `seconds` 0: no cap. `now` is the clock (tests
  // pass their own).
  LocalDeadline(double seconds, comm::Communicator& comm, std::function<Clock::time_point()> now = Clock::now);

  // Whether the round's time is up; an error only when the broadcast fails.
  Result<bool> Reached();

 private:
  double seconds_;
  comm::Communicator& comm_;
  std::function<Clock::time_point()> now_;
  Clock::time_point start_;
};

}  // namespace estuary::client
