// estuary-lm: language-model utilities on the command line.
//
//   estuary-lm tokenize --tokenizer DIR/tokenizer.json [--add-special-tokens] < text
//       each line of standard input (without its newline) -> a JSON array of ids
//   estuary-lm tokenize --tokenizer DIR/tokenizer.json --decode [--skip-special-tokens] < ids
//       each line a JSON array of ids -> its text
//
// The tokenizer is Hugging Face's tokenizer.json (models/tokenizer.h), with
// tokenizer_config.json read from beside it when there. Errors are one line
// on stderr, naming the file and the field or the input line; exit 1.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "base/cli.h"
#include "models/tokenizer.h"

namespace {

using namespace estuary;

constexpr std::string_view kProgram = "estuary-lm";

struct TokenizeFlags {
  std::string tokenizer;
  bool add_special_tokens = false;
  bool decode = false;
  bool skip_special_tokens = false;
};

Status Tokenize(const TokenizeFlags& flags) {
  ESTUARY_ASSIGN_OR_RETURN(models::Tokenizer tokenizer, models::Tokenizer::Load(flags.tokenizer));
  std::ios::sync_with_stdio(false);
  std::string line, out;
  for (size_t number = 1; std::getline(std::cin, line); ++number) {
    if (!flags.decode) {
      fmt::format_to(std::back_inserter(out), "[{}]\n", fmt::join(tokenizer.Encode(line, flags.add_special_tokens), ","));
    } else {
      const nlohmann::json ids = nlohmann::json::parse(line, nullptr, false);
      std::vector<int32_t> values;
      bool ok = ids.is_array();
      for (size_t i = 0; ok && i < ids.size(); ++i) {
        ok = ids[i].is_number_integer() && ids[i].get<int64_t>() >= 0 && ids[i].get<int64_t>() <= INT32_MAX;
        if (ok) values.push_back(int32_t(ids[i].get<int64_t>()));
      }
      if (!ok) {
        // What the lines before it gave is written first.
        std::fwrite(out.data(), 1, out.size(), stdout);
        std::fflush(stdout);
        return InvalidArgument("standard input, line {}: not a JSON array of token ids", number);
      }
      out += tokenizer.Decode(values, flags.skip_special_tokens);
      out += '\n';
    }
    if (out.size() > (1 << 16)) {
      std::fwrite(out.data(), 1, out.size(), stdout);
      out.clear();
    }
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  if (std::fflush(stdout) != 0) return IoError("standard output: cannot write");
  return Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"estuary-lm: language-model utilities"};
  ShowDefaultsInHelp(app);
  app.require_subcommand(1);

  TokenizeFlags tokenize;
  auto* tok = app.add_subcommand("tokenize", "text lines to JSON arrays of token ids (or back, with --decode)");
  tok->add_option("--tokenizer", tokenize.tokenizer, "a Hugging Face tokenizer.json")->required();
  tok->add_flag("--add-special-tokens", tokenize.add_special_tokens,
                "add what the post-processor adds (e.g. BOS) to each line");
  tok->add_flag("--decode", tokenize.decode, "read JSON arrays of ids, write their text");
  tok->add_flag("--skip-special-tokens", tokenize.skip_special_tokens, "with --decode: leave special tokens out");

  if (auto exit = ParseCommandLine(app, argc, argv, kProgram)) return *exit;
  if (tok->parsed()) {
    Status s = Tokenize(tokenize);
    if (!s.ok()) return Fail(kProgram, s);
  }
  return 0;
}
