// Instruction data for the site tests: a small BPE tokenizer in Hugging
// Face's format (tests/client/data/char-bpe: SentencePiece-style, a Metaspace
// pre-tokenizer, the characters of printable ASCII and newline, 30 merges,
// <unk> and the specials <s> </s> <|im_start|> <|im_end|> <pad>: 132 ids, so
// it fits the byte presets' vocabulary of 256; a byte-level BPE needs 256
// byte tokens before any special) and JSON Lines
// files of chats and Alpaca lines whose responses follow a pattern a tiny
// decoder learns in a few steps.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/format.h>

namespace estuary::testing {

inline std::filesystem::path CharBpeTokenizer() {
  return std::filesystem::path(ESTUARY_SOURCE_DIR) / "tests/client/data/char-bpe/tokenizer.json";
}

// `n` examples from `first`: chats (user asks for a sum, assistant answers,
// some with a system turn) and every third an Alpaca line; lengths vary, so
// packed rows score different numbers of targets.
inline void WriteInstructionJsonl(const std::filesystem::path& file, int n, int first = 0) {
  std::ofstream out(file);
  for (int i = first; i < first + n; ++i) {
    const int a = i % 10, b = (i * 7) % 10;
    if (i % 3 == 2) {
      out << fmt::format(R"({{"instruction": "Add the numbers.", "input": "{} and {}", "output": "{} plus {} is {}."}})",
                         a, b, a, b, a + b)
          << "\n";
    } else if (i % 3 == 1) {
      out << fmt::format(R"({{"id": {}, "messages": [{{"role": "system", "content": "Be brief."}}, )"
                         R"({{"role": "user", "content": "What is {} and {}?"}}, )"
                         R"({{"role": "assistant", "content": "{} plus {} is {}."}}]}})",
                         i, a, b, a, b, a + b)
          << "\n";
    } else {
      out << fmt::format(R"({{"messages": [{{"role": "user", "content": "What is {} and {}?"}}, )"
                         R"({{"role": "assistant", "content": "{} plus {} is {}, the sum of the two."}}]}})",
                         a, b, a, b, a + b)
          << "\n";
    }
  }
}

}  // namespace estuary::testing
