// The harness every benchmark in bench/ shares, as nccl-tests' benchmarks
// share theirs. A benchmark runs its baseline in the same process (or in a
// child it starts, such as PyTorch) and prints the ratio; the harness holds
// what that takes besides the work itself:
//
// - Bench: the benchmark's name and command line, with the common flags
//   (--steps/--warmup, --threads, --python, --precision), and the two ways
//   it stops early: Fail ("name: error" on stderr, exit 1) and
//   NothingMeasured (no device to measure on is no error: exit 0, saying
//   why).
// - Repeat times each of a number of calls after untimed warm-up calls;
//   Samples reduces the times to what a report quotes (median, range, mean).
//   SecondsPerCall times a block of calls as one, for work that is queued
//   rather than done (a GPU stream's), the final wait inside the time.
// - PrintRatio prints the line a comparison ends with:
//   "ratio (figure / its baseline): 1.23".
// - RunCommand and CommandOutput run a baseline in a child process;
//   LineChild runs one in step with ours, a line at a time.
//
// Times are in seconds; a name says where a figure is in other units.
#pragma once

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/manifest.h"
#include "base/status.h"

// OpenBLAS's own pool size, for the benchmarks that link it (declared here,
// not in an OpenBLAS header, so that the others need not).
extern "C" void openblas_set_num_threads(int);

namespace estuary::bench {

class Stopwatch {
 public:
  Stopwatch() : start_(std::chrono::steady_clock::now()) {}
  double Seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  std::chrono::steady_clock::time_point start_;
};

// Figures from repeated measurements, kept sorted.
class Samples {
 public:
  void Add(double value);
  size_t size() const { return sorted_.size(); }
  // The upper of the two middle values for an even count; 0 when empty. A
  // median shrugs off a repetition that lost its core for a while, which on
  // a shared machine is most of the noise.
  double median() const { return sorted_.empty() ? 0 : sorted_[sorted_.size() / 2]; }
  double min() const { return sorted_.empty() ? 0 : sorted_.front(); }
  double max() const { return sorted_.empty() ? 0 : sorted_.back(); }
  double mean() const { return sorted_.empty() ? 0 : sum_ / double(sorted_.size()); }

 private:
  std::vector<double> sorted_;
  double sum_ = 0;
};

// "12.3 ms (range 11.9-14.0 over 10)": the median and range of samples in
// seconds, as milliseconds.
std::string MedianAndRangeMs(const Samples& seconds);

struct Repetitions {
  int warmup = 1;  // untimed calls first: caches, page faults, lazy set-up
  int timed = 10;
};

// Calls `once` r.warmup times, then r.timed times timing each call; the
// first error ends it.
Result<Samples> Repeat(const Repetitions& r, const std::function<Status()>& once);

// Seconds per call of `calls` calls of `once` in a row followed by `finish`
// (which waits for what the calls queued), timed as one block.
Result<double> SecondsPerCall(int calls, const std::function<Status()>& once,
                              const std::function<Status()>& finish = nullptr);

// "ratio (compared): 1.23" on standard output, e.g. compared = "pytorch /
// estuary"; the second form puts several figures of one comparison on its
// line: "ratio (LoRA / full): tokens/s 1.23, memory 0.45".
void PrintRatio(std::string_view compared, double ratio, int decimals = 2);
void PrintRatio(std::string_view compared, const std::vector<std::pair<std::string, double>>& ratios,
                int decimals = 2);

// Runs `command` through /bin/sh and hands each line of its standard output,
// without the newline, to `line`. An error when it cannot start or does not
// exit 0.
Status RunCommand(const std::string& command, const std::function<void(std::string_view line)>& line);
// The whole of `command`'s standard output.
Result<std::string> CommandOutput(const std::string& command);

// A baseline that runs in step with ours, spoken to line by line: `command`
// through /bin/sh with its standard input and output on one socket to us
// (its standard error passes through). bench/llama_step asks PyTorch for one
// step at a time between its own, so load from other processes on a shared
// machine falls on both sides alike.
class LineChild {
 public:
  static Result<std::unique_ptr<LineChild>> Start(const std::string& command);
  LineChild(const LineChild&) = delete;
  LineChild& operator=(const LineChild&) = delete;
  // A child not yet finished is killed and waited for.
  ~LineChild();

  // Writes `line` and a newline to the child's standard input.
  Status Send(std::string_view line);
  // The child's next line of output, without the newline; an error (naming
  // the command) when it closed its output first.
  Result<std::string> Receive();
  // Closes the child's input, waits for it: an error unless it exits 0.
  Status Finish();

 private:
  LineChild(std::string command, int pid, int fd) : command_(std::move(command)), pid_(pid), fd_(fd) {}
  std::string command_;
  int pid_ = -1, fd_ = -1;
  std::string pending_;  // received, not yet returned
};

// For a flag: a whole number of at least `least`. (CLI::PositiveNumber's
// message names the largest double as its bound.)
CLI::Validator AtLeast(int least);

// `python` running bench/<script> of this source tree.
std::string ScriptCommand(const std::string& python, std::string_view script);

class Bench {
 public:
  // Standard output is made line-buffered, so a benchmark stopped by a time
  // limit still leaves every line it finished.
  Bench(std::string name, const std::string& description) : name_(std::move(name)), app_(description, name_) {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
  }

  CLI::App& app() { return app_; }

  // --steps (timed calls, at least 1) and --warmup (untimed calls first),
  // bound to r, which holds the benchmark's defaults.
  void AddRepetitions(Repetitions& r);
  // --threads: at least 1; `help` says whose threads they are.
  void AddThreads(int& threads, const std::string& help);
  // --python: the interpreter, with PyTorch, that runs the baseline.
  void AddPython(std::string& python);
  // --precision f32 | bf16 | f16, into `dtype`, which holds the default;
  // `help` says which of them the benchmark takes.
  void AddPrecision(DType& dtype, const std::string& help);

  // Parses the command line: nothing to go on with, or the code to exit
  // with now (after --help, or a flag it refused).
  std::optional<int> Parse(int argc, char** argv);

  // "name: error" on stderr; returns 1, the exit code.
  int Fail(const Status& status) const;
  // "name: nothing measured: why" on stdout; returns 0: nothing is wrong
  // with the benchmark where there is nothing to measure on.
  int NothingMeasured(std::string_view why) const;

 private:
  std::string name_;
  CLI::App app_;
};

}  // namespace estuary::bench
