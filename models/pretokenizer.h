// The pre-tokenizer patterns of Hugging Face byte-level BPE files, matched by
// hand rather than by a regex engine: the patterns are few and fixed, and a
// hand matcher gives Oniguruma's answers (\s is White_Space, \p{L} and \p{N}
// the general categories) without one.
//
//   SplitPattern p = *SplitPattern::FromRegex(json_regex);   // or Gpt2()
//   std::vector<std::string_view> pieces;
//   p.Split(text, &pieces);   // every byte of text in exactly one piece, in order
//
// The patterns known (anything else is refused, naming it):
//   Llama 3   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//   Qwen 2/3  the same with \p{N} alone
//   GPT-2     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+  (ByteLevel's use_regex)
#pragma once

#include <array>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace estuary::models {

struct SplitPattern {
  bool contractions_ignore_case = false;  // (?i:'s|...) rather than 's|...
  bool letters_after_any_prefix = false;  // [^\r\n\p{L}\p{N}]?\p{L}+ rather than ` ?\p{L}+`
  int max_digits = 0;                     // \p{N}{1,max}; 0: ` ?\p{N}+`
  bool punctuation_takes_newlines = false;  // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
  bool newline_runs = false;              // `\s*[\r\n]+`

  static SplitPattern Gpt2();
  // The pattern a Split pre-tokenizer's "Regex" names, or an error naming it.
  static Result<SplitPattern> FromRegex(std::string_view regex);

  // Cuts valid UTF-8 `text` into the pattern's matches (and, were there any,
  // the text between them), appending views into `text`.
  void Split(std::string_view text, std::vector<std::string_view>* pieces) const;
};

// GPT-2's reversible map of bytes to printable characters, which byte-level
// vocabularies are written in: each byte's character as UTF-8.
const std::array<std::string, 256>& ByteLevelAlphabet();

}  // namespace estuary::models
