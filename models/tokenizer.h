// A Hugging Face tokenizer read from its tokenizer.json (and the
// tokenizer_config.json beside it), giving the ids Hugging Face's tokenizers
// give: byte-level BPE (GPT-2, Llama 3, Qwen) and SentencePiece-style BPE
// with byte fallback (Llama 2, TinyLlama, Mistral).
//
//   ESTUARY_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Load("llama3/tokenizer.json"));
//   std::vector<int32_t> ids = tok.Encode("Hello world", /*add_special_tokens=*/true);
//   std::string text = tok.Decode(ids, /*skip_special_tokens=*/true);
//
// Encode runs Hugging Face's pipeline: added tokens are cut out of the text
// first (leftmost longest; lstrip, rstrip, single_word and normalized as
// there), the rest is normalized, pre-tokenized and cut into tokens by the
// model, and with add_special_tokens the post-processor's template adds its
// tokens. Invalid UTF-8 is read as after a decode with replacement (each
// maximal invalid subpart one U+FFFD; models/unicode.h). Decode maps ids to
// tokens (an unknown id is left out, as there) and runs the decoder.
//
// What the file may hold: normalizers Sequence, NFC, Prepend, Replace (a
// string); pre-tokenizers Sequence, Split (the patterns of
// models/pretokenizer.h, Isolated), ByteLevel, Metaspace; the BPE model;
// post-processors TemplateProcessing, ByteLevel, Sequence; decoders
// Sequence, ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace.
// Anything else is refused at Load with one line naming the file and the
// field ("tokenizer.json: pre_tokenizer.pretokenizers[0].type: 'Digits' is
// not supported").
//
// A Tokenizer is immutable after Load; copies share it, and Encode/Decode
// may run on many threads at once.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace estuary::models {

struct TokenizerImpl;

class Tokenizer {
 public:
  // Reads `tokenizer_json`, and tokenizer_config.json from its directory
  // when there is one (the BOS, EOS and pad tokens).
  static Result<Tokenizer> Load(const std::filesystem::path& tokenizer_json);
  // The same from the files' text; `name` is what errors call the tokenizer
  // file, and `config` may be empty (no tokenizer_config.json).
  static Result<Tokenizer> FromJson(std::string_view json, std::string_view config, const std::string& name);

  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens) const;
  std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens) const;

  // Every id below this has a token (the model's and the added ones).
  int32_t vocab_size() const;
  std::optional<int32_t> TokenToId(std::string_view token) const;
  std::optional<std::string> IdToToken(int32_t id) const;
  bool IsSpecial(int32_t id) const;

  // From tokenizer_config.json (nullopt when it names none, or is absent).
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  std::optional<int32_t> pad_id() const;

 private:
  explicit Tokenizer(std::shared_ptr<const TokenizerImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const TokenizerImpl> impl_;
};

}  // namespace estuary::models
