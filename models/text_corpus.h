// Text for the language models: a byte-level tokenizer and a corpus of
// sources (one per topic file of Debian's `fortunes` package), each split into
// train and test token streams.
//
// A token is one byte (vocabulary 256), so any UTF-8 text encodes losslessly
// and no vocabulary file travels with a model. A source is split by whole
// documents (one fortune each, the `%` lines between them), each assigned to
// test with probability test_fraction by a hash of (seed, source, index):
// the same seed always gives the same split, independent of file order.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace estuary::models {

struct ByteTokenizer {
  static constexpr int kVocabSize = 256;
  static std::vector<int32_t> Encode(std::string_view text);
  // Fails on a token outside [0, 256), naming it and its position.
  static Result<std::string> Decode(std::span<const int32_t> tokens);
};

struct TextSource {
  std::string name;              // the topic file's name, e.g. "science"
  std::vector<int32_t> train;    // documents joined, each followed by "\n%\n"
  std::vector<int32_t> test;
  uint64_t train_documents = 0;
  uint64_t test_documents = 0;
};

struct CorpusOptions {
  double test_fraction = 0.1;
  uint64_t seed = 0;
  // Sources with fewer train or test tokens than this are left out: a client
  // needs at least one window of context + 1 tokens on each side.
  uint64_t min_tokens = 0;
};

// Splits one fortune file's text into its documents (trimmed of the `%` lines;
// empty documents dropped).
std::vector<std::string_view> SplitFortunes(std::string_view text);

// Loads every regular file of `dir` that looks like a fortune file (no
// extension; .dat indexes and .u8 links are skipped), sorted by name. Errors
// name the directory or file. Fails when no source survives min_tokens.
Result<std::vector<TextSource>> LoadFortunes(const std::filesystem::path& dir, const CorpusOptions& options);

// The default place Debian installs the fortunes.
inline constexpr std::string_view kDefaultFortunesDir = "/usr/share/games/fortunes";

}  // namespace estuary::models
