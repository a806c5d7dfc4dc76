// The encode and decode pipelines of models/tokenizer.h; loading is in
// tokenizer_json.cc.
#include "models/tokenizer.h"

#include <algorithm>

#include "models/tokenizer_impl.h"
#include "models/unicode.h"

namespace estuary::models {

namespace {

void ReplaceAll(std::string* s, std::string_view from, std::string_view to) {
  if (from.empty() || s->find(from) == std::string::npos) return;
  std::string out;
  size_t at = 0;
  for (size_t hit; (hit = s->find(from, at)) != std::string::npos; at = hit + from.size()) {
    out.append(*s, at, hit - at);
    out.append(to);
  }
  out.append(*s, at);
  *s = std::move(out);
}

// The code point before text[at] (0 at the start), and the one at it.
char32_t CodePointBefore(std::string_view text, size_t at) {
  if (at == 0) return 0;
  size_t start = at - 1;
  while (start > 0 && (uint8_t(text[start]) & 0xC0) == 0x80) --start;
  return unicode::NextCodePoint(text, &start);
}

// A piece of the text on its way through the pipeline: either an added
// token's id or text still to tokenize; `at_start` when it begins at the
// input's first byte (Metaspace's prepend_scheme "first").
struct Piece {
  std::string text;
  int32_t id = -1;
  bool at_start = false;
};

// Cuts `text` at the added tokens `matcher` finds, as Hugging Face's
// AddedVocabulary::find_matches: a single_word token must not touch a word
// character, lstrip/rstrip take the whitespace beside the token with it.
void SplitAdded(const TokenizerImpl& t, const AddedTokenMatcher& matcher, std::string_view text, bool at_start,
                std::vector<Piece>* out) {
  if (matcher.empty()) {
    out->push_back({std::string(text), -1, at_start});
    return;
  }
  size_t done = 0;  // text before this is in `out`
  for (size_t at = 0; at < text.size();) {
    size_t length, index;
    if (!matcher.MayStartWith(uint8_t(text[at])) || !matcher.LongestAt(text, at, &length, &index)) {
      ++at;
      continue;
    }
    const AddedToken& token = t.added[index];
    size_t start = at, stop = at + length;
    at = stop;
    if (token.single_word) {
      const bool word_before = start > 0 && unicode::IsWordChar(CodePointBefore(text, start));
      size_t after = stop;
      const bool word_after = stop < text.size() && unicode::IsWordChar(unicode::NextCodePoint(text, &after));
      if (word_before || word_after) continue;
    }
    if (token.lstrip) {
      size_t s = start;
      while (s > done && unicode::IsWhitespace(CodePointBefore(text, s))) {
        --s;
        while (s > done && (uint8_t(text[s]) & 0xC0) == 0x80) --s;
      }
      start = s;
    }
    if (token.rstrip) {
      while (stop < text.size()) {
        size_t next = stop;
        if (!unicode::IsWhitespace(unicode::NextCodePoint(text, &next))) break;
        stop = next;
      }
      at = stop;
    }
    if (done < start) out->push_back({std::string(text.substr(done, start - done)), -1, at_start && done == 0});
    out->push_back({std::string(), token.id, false});
    done = stop;
  }
  if (done < text.size()) out->push_back({std::string(text.substr(done)), -1, at_start && done == 0});
}

void PreTokenize(const PreTokenizerStep& step, Piece piece, std::vector<Piece>* out) {
  switch (step.kind) {
    case PreTokenizerStep::kSplit: {
      std::vector<std::string_view> parts;
      step.pattern.Split(piece.text, &parts);
      for (size_t i = 0; i < parts.size(); ++i) out->push_back({std::string(parts[i]), -1, piece.at_start && i == 0});
      return;
    }
    case PreTokenizerStep::kByteLevel: {
      // (A new string rather than insert(0, ...): GCC 12 warns falsely on that.)
      if (step.add_prefix_space && piece.text.front() != ' ') piece.text = " " + piece.text;
      if (!step.use_regex) {
        out->push_back(std::move(piece));
        return;
      }
      std::vector<std::string_view> parts;
      step.pattern.Split(piece.text, &parts);
      for (size_t i = 0; i < parts.size(); ++i) out->push_back({std::string(parts[i]), -1, piece.at_start && i == 0});
      return;
    }
    case PreTokenizerStep::kMetaspace: {
      ReplaceAll(&piece.text, " ", step.replacement);
      const bool prepend = step.prepend == PreTokenizerStep::kAlways ||
                           (step.prepend == PreTokenizerStep::kFirst && piece.at_start);
      if (prepend && !piece.text.starts_with(step.replacement)) piece.text = step.replacement + piece.text;
      if (!step.split) {
        out->push_back(std::move(piece));
        return;
      }
      // Split on the replacement, each one starting a new piece (MergedWithNext).
      size_t from = 0;
      for (size_t hit = piece.text.find(step.replacement, 1); hit != std::string::npos;
           hit = piece.text.find(step.replacement, hit + step.replacement.size())) {
        if (hit > from) out->push_back({piece.text.substr(from, hit - from), -1, piece.at_start && from == 0});
        from = hit;
      }
      out->push_back({piece.text.substr(from), -1, piece.at_start && from == 0});
      return;
    }
  }
}

}  // namespace

void AddedTokenMatcher::Add(std::string pattern, size_t token) {
  if (pattern.empty()) return;
  for (const auto& [p, t] : patterns_) {
    if (p == pattern) return;
  }
  patterns_.emplace_back(std::move(pattern), token);
  const size_t index = patterns_.size() - 1;
  auto& list = by_first_byte_[uint8_t(patterns_[index].first[0])];
  list.push_back(index);
  std::stable_sort(list.begin(), list.end(),
                   [&](size_t a, size_t b) { return patterns_[a].first.size() > patterns_[b].first.size(); });
}

bool AddedTokenMatcher::LongestAt(std::string_view text, size_t at, size_t* length, size_t* token) const {
  for (size_t index : by_first_byte_[uint8_t(text[at])]) {
    const std::string& p = patterns_[index].first;
    if (text.substr(at).starts_with(p)) {
      *length = p.size();
      *token = patterns_[index].second;
      return true;
    }
  }
  return false;
}

std::string TokenizerImpl::Normalize(std::string text) const {
  for (const NormalizerStep& step : normalizers) {
    switch (step.kind) {
      case NormalizerStep::kNfc: text = unicode::Nfc(text); break;
      case NormalizerStep::kPrepend:
        if (!text.empty()) text = step.text + text;
        break;
      case NormalizerStep::kReplace: ReplaceAll(&text, step.text, step.content); break;
    }
  }
  return text;
}

std::vector<int32_t> Tokenizer::Encode(std::string_view input, bool add_special_tokens) const {
  const TokenizerImpl& t = *impl_;
  std::string repaired;
  if (!unicode::Utf8Valid(input)) {
    repaired = unicode::ReplaceInvalidUtf8(input);
    input = repaired;
  }
  std::vector<int32_t> ids;
  ids.reserve(input.size() / 3 + 4);
  if (add_special_tokens) ids = t.template_prefix;

  std::vector<Piece> raw, normalized, pieces, next;
  SplitAdded(t, t.raw_added, input, true, &raw);
  for (Piece& r : raw) {
    if (r.id >= 0) {
      ids.push_back(r.id);
      continue;
    }
    normalized.clear();
    SplitAdded(t, t.normalized_added, t.Normalize(std::move(r.text)), r.at_start, &normalized);
    for (Piece& n : normalized) {
      if (n.id >= 0) {
        ids.push_back(n.id);
        continue;
      }
      pieces.clear();
      if (!n.text.empty()) pieces.push_back(std::move(n));
      for (const PreTokenizerStep& step : t.pre_tokenizers) {
        next.clear();
        for (Piece& p : pieces) {
          if (!p.text.empty()) PreTokenize(step, std::move(p), &next);
        }
        std::swap(pieces, next);
      }
      for (const Piece& p : pieces) t.model->Encode(p.text, &ids);
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), t.template_suffix.begin(), t.template_suffix.end());
  return ids;
}

namespace {

bool IsByteToken(std::string_view token, uint8_t* byte) {
  if (token.size() != 6 || !token.starts_with("<0x") || token[5] != '>') return false;
  const auto hex = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1; };
  const int hi = hex(token[3]), lo = hex(token[4]);
  if (hi < 0 || lo < 0) return false;
  *byte = uint8_t(hi * 16 + lo);
  return true;
}

void RunDecoder(const DecoderStep& step, std::vector<std::string>* tokens) {
  switch (step.kind) {
    case DecoderStep::kByteLevel: {
      // Each token's characters back to bytes; a token with a character
      // outside the alphabet stays as its own UTF-8. Then one lossy decode.
      static const auto byte_of = [] {
        std::unordered_map<std::string, uint8_t> m;
        const auto& alphabet = ByteLevelAlphabet();
        for (int b = 0; b < 256; ++b) m[alphabet[b]] = uint8_t(b);
        return m;
      }();
      std::string bytes;
      for (const std::string& token : *tokens) {
        std::string mapped;
        bool all = true;
        for (size_t at = 0; at < token.size() && all;) {
          const size_t start = at;
          unicode::NextCodePoint(token, &at);
          auto it = byte_of.find(token.substr(start, at - start));
          if (it == byte_of.end()) all = false;
          else mapped.push_back(char(it->second));
        }
        bytes += all ? mapped : token;
      }
      *tokens = {unicode::ReplaceInvalidUtf8(bytes)};
      return;
    }
    case DecoderStep::kReplace:
      for (std::string& token : *tokens) ReplaceAll(&token, step.text, step.content);
      return;
    case DecoderStep::kByteFallback: {
      // Runs of <0xNN> become their bytes when those are valid UTF-8, else
      // one U+FFFD per byte token.
      std::vector<std::string> out;
      std::string run;
      size_t run_tokens = 0;
      const auto flush = [&] {
        if (!run_tokens) return;
        if (unicode::Utf8Valid(run)) out.push_back(run);
        else for (size_t i = 0; i < run_tokens; ++i) out.push_back("\xEF\xBF\xBD");
        run.clear();
        run_tokens = 0;
      };
      for (std::string& token : *tokens) {
        uint8_t byte;
        if (IsByteToken(token, &byte)) {
          run.push_back(char(byte));
          ++run_tokens;
        } else {
          flush();
          out.push_back(std::move(token));
        }
      }
      flush();
      *tokens = std::move(out);
      return;
    }
    case DecoderStep::kFuse: {
      std::string all;
      for (const std::string& token : *tokens) all += token;
      *tokens = {std::move(all)};
      return;
    }
    case DecoderStep::kStrip:
      for (std::string& token : *tokens) {
        size_t begin = 0;
        for (int i = 0; i < step.start && token.compare(begin, step.content.size(), step.content) == 0; ++i) {
          begin += step.content.size();
        }
        size_t end = token.size();
        for (int i = 0; i < step.stop && end >= begin + step.content.size() &&
                        token.compare(end - step.content.size(), step.content.size(), step.content) == 0;
             ++i) {
          end -= step.content.size();
        }
        token = token.substr(begin, end - begin);
      }
      return;
    case DecoderStep::kMetaspace:
      // Hugging Face drops every replacement of the first token, not only a
      // leading one, unless the encoder never prepends.
      for (size_t i = 0; i < tokens->size(); ++i) ReplaceAll(&(*tokens)[i], step.text, i == 0 && step.prepend ? "" : " ");
      return;
  }
}

}  // namespace

std::string Tokenizer::Decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const TokenizerImpl& t = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || size_t(id) >= t.tokens.size() || !t.has_token[id]) continue;
    if (skip_special_tokens && t.special[id]) continue;
    tokens.push_back(t.tokens[id]);
  }
  if (!t.has_decoder) {
    std::string joined;
    for (size_t i = 0; i < tokens.size(); ++i) joined += (i ? " " : "") + tokens[i];
    return joined;
  }
  for (const DecoderStep& step : t.decoders) RunDecoder(step, &tokens);
  std::string out;
  for (const std::string& token : tokens) out += token;
  return out;
}

int32_t Tokenizer::vocab_size() const { return int32_t(impl_->tokens.size()); }

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  auto it = impl_->ids.find(std::string(token));
  if (it == impl_->ids.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> Tokenizer::IdToToken(int32_t id) const {
  if (id < 0 || size_t(id) >= impl_->tokens.size() || !impl_->has_token[id]) return std::nullopt;
  return impl_->tokens[id];
}

bool Tokenizer::IsSpecial(int32_t id) const { return id >= 0 && size_t(id) < impl_->special.size() && impl_->special[id]; }
std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos; }
std::optional<int32_t> Tokenizer::pad_id() const { return impl_->pad; }

}  // namespace estuary::models
