// Clock: the time the round logic reads and the timers it arms (a round's
// deadline, the pause before a failed round is retried), behind one
// interface so that tests drive time instead of waiting for it.
//
// Now() measures durations; UnixMs() stamps the round log and the deadline a
// RoundStart announces. A Timer calls back on the I/O thread, once, unless it
// is cancelled or armed again first; destroying it cancels it. AsioClock is
// the real one: the system clocks and steady_timers on the I/O executor.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "base/asio.h"

namespace estuary::server {

class Timer {
 public:
  virtual ~Timer() = default;
  virtual void Arm(std::chrono::steady_clock::duration delay, std::function<void()> fire) = 0;
  virtual void Cancel() = 0;
};

class Clock {
 public:
  virtual ~Clock() = default;
  virtual std::chrono::steady_clock::time_point Now() const = 0;
  virtual int64_t UnixMs() const = 0;
  virtual std::unique_ptr<Timer> MakeTimer() = 0;
};

class AsioClock final : public Clock {
 public:
  explicit AsioClock(boost::asio::any_io_executor io) : io_(std::move(io)) {}
  std::chrono::steady_clock::time_point Now() const override { return std::chrono::steady_clock::now(); }
  int64_t UnixMs() const override;
  std::unique_ptr<Timer> MakeTimer() override;

 private:
  boost::asio::any_io_executor io_;
};

}  // namespace estuary::server
