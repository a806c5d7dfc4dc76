// The parts of a loaded Tokenizer (models/tokenizer.h): what
// tokenizer_json.cc reads from the files and tokenizer.cc runs. Not a public
// header: nothing outside those two files includes it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "models/bpe.h"
#include "models/pretokenizer.h"

namespace estuary::models {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

// Finds added tokens leftmost-longest, as Hugging Face's Aho-Corasick
// automaton does (MatchKind::LeftmostLongest).
class AddedTokenMatcher {
 public:
  // `pattern` is what the text must hold (for a normalized token: its
  // content normalized); `token` indexes the tokenizer's added tokens.
  void Add(std::string pattern, size_t token);
  bool empty() const { return patterns_.empty(); }
  // The longest pattern starting at text[at], or false.
  bool LongestAt(std::string_view text, size_t at, size_t* length, size_t* token) const;
  bool MayStartWith(unsigned char c) const { return !by_first_byte_[c].empty(); }

 private:
  std::vector<std::pair<std::string, size_t>> patterns_;
  std::vector<size_t> by_first_byte_[256];  // indices into patterns_, longest first
};

struct NormalizerStep {
  enum Kind { kNfc, kPrepend, kReplace } kind;
  std::string text, content;  // Prepend: text; Replace: text -> content
};

struct PreTokenizerStep {
  enum Kind { kSplit, kByteLevel, kMetaspace } kind;
  SplitPattern pattern;           // Split; ByteLevel with use_regex: GPT-2's
  bool use_regex = false;         // ByteLevel
  bool add_prefix_space = false;  // ByteLevel
  std::string replacement;        // Metaspace
  enum Prepend { kAlways, kFirst, kNever } prepend = kAlways;  // Metaspace
  bool split = false;             // Metaspace
};

struct DecoderStep {
  enum Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind;
  std::string text, content;  // Replace: text -> content; Strip: content; Metaspace: text
  int start = 0, stop = 0;    // Strip
  bool prepend = true;        // Metaspace: the first token lost its prepended space
};

struct TokenizerImpl {
  std::string name;  // the file, for messages
  std::vector<NormalizerStep> normalizers;
  std::vector<PreTokenizerStep> pre_tokenizers;
  std::optional<Bpe> model;
  std::vector<int32_t> template_prefix, template_suffix;  // add_special_tokens
  bool has_decoder = false;
  std::vector<DecoderStep> decoders;

  std::vector<AddedToken> added;
  AddedTokenMatcher raw_added, normalized_added;

  std::vector<std::string> tokens;  // by id, as the file spells them ("" where no token)
  std::vector<bool> has_token, special;
  std::unordered_map<std::string, int32_t> ids;  // added tokens, then the model's

  std::optional<int32_t> bos, eos, pad;

  std::string Normalize(std::string text) const;
};

}  // namespace estuary::models
