#include "bench/harness.h"

#include <fmt/format.h>
#include <sys/wait.h>

#include <algorithm>
#include <charconv>
#include <cstdio>

namespace estuary::bench {

void Samples::Add(double value) {
  sorted_.insert(std::upper_bound(sorted_.begin(), sorted_.end(), value), value);
  sum_ += value;
}

std::string MedianAndRangeMs(const Samples& seconds) {
  return fmt::format("{:.1f} ms (range {:.1f}-{:.1f} over {})", seconds.median() * 1e3, seconds.min() * 1e3,
                     seconds.max() * 1e3, seconds.size());
}

Result<Samples> Repeat(const Repetitions& r, const std::function<Status()>& once) {
  for (int i = 0; i < r.warmup; ++i) ESTUARY_RETURN_IF_ERROR(once());
  Samples seconds;
  for (int i = 0; i < r.timed; ++i) {
    const Stopwatch watch;
    ESTUARY_RETURN_IF_ERROR(once());
    seconds.Add(watch.Seconds());
  }
  return seconds;
}

Result<double> SecondsPerCall(int calls, const std::function<Status()>& once, const std::function<Status()>& finish) {
  if (calls < 1) return InvalidArgument("bench: {} calls to time", calls);
  const Stopwatch watch;
  for (int i = 0; i < calls; ++i) ESTUARY_RETURN_IF_ERROR(once());
  if (finish) ESTUARY_RETURN_IF_ERROR(finish());
  return watch.Seconds() / calls;
}

void PrintRatio(std::string_view compared, double ratio, int decimals) {
  fmt::print("ratio ({}): {:.{}f}\n", compared, ratio, decimals);
}

void PrintRatio(std::string_view compared, const std::vector<std::pair<std::string, double>>& ratios, int decimals) {
  std::string figures;
  for (const auto& [what, ratio] : ratios) {
    figures += fmt::format("{}{} {:.{}f}", figures.empty() ? "" : ", ", what, ratio, decimals);
  }
  fmt::print("ratio ({}): {}\n", compared, figures);
}

Status RunCommand(const std::string& command, const std::function<void(std::string_view line)>& line) {
  // Whatever this process printed goes out before the child's output can.
  std::fflush(stdout);
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return IoError("cannot run {}", command);
  std::string text;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) {
    text.append(buffer, n);
    size_t end;
    while ((end = text.find('\n')) != std::string::npos) {
      line(std::string_view(text).substr(0, end));
      text.erase(0, end + 1);
    }
  }
  if (!text.empty()) line(text);
  const int status = pclose(pipe);
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return Internal("{} failed ({})", command,
                    status != -1 && WIFEXITED(status) ? fmt::format("exit status {}", WEXITSTATUS(status))
                                                      : std::string("killed or not waited for"));
  }
  return Status::Ok();
}

Result<std::string> CommandOutput(const std::string& command) {
  std::string out;
  ESTUARY_RETURN_IF_ERROR(RunCommand(command, [&](std::string_view line) {
    out.append(line);
    out += '\n';
  }));
  return out;
}

std::string ScriptCommand(const std::string& python, std::string_view script) {
  return fmt::format("{} {}/bench/{}", python, ESTUARY_SOURCE_DIR, script);
}

CLI::Validator AtLeast(int least) {
  return CLI::Validator(
      [least](std::string& text) -> std::string {
        int value = 0;
        const char* end = text.data() + text.size();
        const auto parsed = std::from_chars(text.data(), end, value);
        if (parsed.ec == std::errc() && parsed.ptr == end && value >= least) return {};
        return fmt::format("{} is not a whole number of at least {}", text, least);
      },
      fmt::format(">= {}", least));
}

void Bench::AddRepetitions(Repetitions& r) {
  app_.add_option("--steps", r.timed, "timed steps")->check(AtLeast(1));
  app_.add_option("--warmup", r.warmup, "untimed steps first")->check(AtLeast(0));
}

void Bench::AddThreads(int& threads, const std::string& help) {
  app_.add_option("--threads", threads, help)->check(AtLeast(1));
}

void Bench::AddPython(std::string& python) {
  app_.add_option("--python", python, "the Python (with PyTorch) that runs the baseline");
}

void Bench::AddPrecision(DType& dtype, const std::string& help) {
  const CLI::Validator known(
      [](std::string& name) {
        auto parsed = ParseDType(name);
        return parsed.ok() ? std::string() : parsed.status().message();
      },
      "f32|bf16|f16");
  app_.add_option_function<std::string>(
          "--precision", [&dtype](const std::string& name) { dtype = *ParseDType(name); }, help)
      ->check(known)
      ->default_str(std::string(DTypeName(dtype)));
}

std::optional<int> Bench::Parse(int argc, char** argv) {
  try {
    app_.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app_.exit(e);
  }
  return std::nullopt;
}

int Bench::Fail(const Status& status) const {
  fmt::print(stderr, "{}: {}\n", name_, status.ToString());
  return 1;
}

int Bench::NothingMeasured(std::string_view why) const {
  fmt::print("{}: nothing measured: {}\n", name_, why);
  return 0;
}

}  // namespace estuary::bench
