// Byte-pair encoding as Hugging Face's tokenizers apply it: a word starts as
// its characters (byte-level files: its bytes), and the pair of adjacent
// symbols with the lowest merge rank is merged, leftmost first, until no
// pair has a merge.
//
//   Bpe bpe(options);
//   bpe.AddToken("hello", 31373) ...; bpe.AddMerge("hel", "lo") ...;   // in rank order
//   bpe.Encode(word, &ids);
//
// Tokens and merges are given as the file writes them; a byte-level model
// (options.byte_level) reads them through GPT-2's byte alphabet, so that it
// encodes the raw bytes of a word without mapping each word first.
// A character missing from the vocabulary becomes its bytes as <0xNN>
// tokens (byte_fallback), else the unknown token (consecutive ones fused
// under fuse_unk), else nothing, as there.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "base/status.h"

namespace estuary::models {

class Bpe {
 public:
  struct Options {
    bool byte_level = false;
    bool byte_fallback = false;
    bool ignore_merges = false;  // a word that is itself a token is that token
    bool fuse_unk = false;
    std::optional<int32_t> unk_id;
  };

  explicit Bpe(Options options) : options_(options) {}

  // An error when the token's string or id is already taken.
  Status AddToken(std::string_view token, int32_t id);
  // The next merge in rank order. An error names the part that is not a
  // token, or the merged token that is missing.
  Status AddMerge(std::string_view left, std::string_view right);
  // After the last AddToken: byte-level models need every byte's token.
  Status Finish();

  // Appends the ids of `word` (raw bytes for a byte-level model, UTF-8 text otherwise).
  void Encode(std::string_view word, std::vector<int32_t>* ids) const;

  std::optional<int32_t> Find(std::string_view token) const;
  const Options& options() const { return options_; }

 private:
  struct Merge {
    int32_t rank;
    int32_t id;
  };
  static uint64_t PairKey(int32_t a, int32_t b) { return uint64_t(uint32_t(a)) << 32 | uint32_t(b); }
  // The file's spelling of a token in the model's own (byte-level: raw bytes).
  std::optional<std::string> ModelSpelling(std::string_view token) const;
  void InitialSymbols(std::string_view word, std::vector<int32_t>* symbols) const;

  Options options_;
  std::unordered_map<std::string, int32_t> vocab_;  // in the model's spelling
  std::unordered_map<uint64_t, Merge> merges_;
  std::unordered_map<std::string, char> byte_of_char_;  // byte-level: alphabet character -> byte
  int32_t byte_ids_[256];                               // byte-level: each byte's token, or -1
  int32_t fallback_ids_[256];                           // byte_fallback: <0xNN>, or -1
};

}  // namespace estuary::models
