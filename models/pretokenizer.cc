#include "models/pretokenizer.h"

#include "models/unicode.h"

namespace estuary::models {

namespace {

constexpr std::string_view kLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kGpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct Char {
  char32_t c;
  size_t at;  // byte offset in the text
};

bool IsNewline(char32_t c) { return c == '\r' || c == '\n'; }
// [^\s\p{L}\p{N}]
bool IsOther(char32_t c) { return !unicode::IsWhitespace(c) && !unicode::IsLetter(c) && !unicode::IsNumber(c); }

// Under (?i) Oniguruma folds case by Unicode's simple folding, which for the
// letters of the contractions adds only U+017F (long s) to 's'.
char32_t Fold(char32_t c, bool ignore_case) {
  if (!ignore_case) return c;
  if (c >= 'A' && c <= 'Z') return c | 0x20;
  return c == 0x17F ? U's' : c;
}

}  // namespace

SplitPattern SplitPattern::Gpt2() { return SplitPattern{}; }

Result<SplitPattern> SplitPattern::FromRegex(std::string_view regex) {
  SplitPattern p;
  if (regex == kGpt2) return p;
  if (regex == kLlama3 || regex == kQwen) {
    p.contractions_ignore_case = true;
    p.letters_after_any_prefix = true;
    p.max_digits = regex == kLlama3 ? 3 : 1;
    p.punctuation_takes_newlines = true;
    p.newline_runs = true;
    return p;
  }
  return InvalidArgument("the Split pattern {} is not one this tokenizer knows (Llama 3's, Qwen's or GPT-2's)",
                         std::string(regex));
}

void SplitPattern::Split(std::string_view text, std::vector<std::string_view>* pieces) const {
  std::vector<Char> s;
  s.reserve(text.size());
  for (size_t at = 0; at < text.size();) {
    const size_t start = at;
    s.push_back({unicode::NextCodePoint(text, &at), start});
  }
  const size_t n = s.size();
  const auto ws = [&](size_t i) { return i < n && unicode::IsWhitespace(s[i].c); };
  const auto letter = [&](size_t i) { return i < n && unicode::IsLetter(s[i].c); };
  const auto number = [&](size_t i) { return i < n && unicode::IsNumber(s[i].c); };
  const auto other = [&](size_t i) { return i < n && IsOther(s[i].c); };
  const auto emit = [&](size_t i, size_t j) {
    const size_t end = j < n ? s[j].at : text.size();
    pieces->push_back(text.substr(s[i].at, end - s[i].at));
  };

  for (size_t i = 0; i < n;) {
    size_t j = i;
    // 's|'t|'re|'ve|'m|'ll|'d
    if (s[i].c == '\'' && i + 1 < n) {
      const char32_t a = Fold(s[i + 1].c, contractions_ignore_case);
      const char32_t b = i + 2 < n ? Fold(s[i + 2].c, contractions_ignore_case) : 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') j = i + 2;
      else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) j = i + 3;
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+  or  ` ?\p{L}+`
    if (j == i) {
      size_t k = i;
      if (letters_after_any_prefix ? (!IsNewline(s[i].c) && !letter(i) && !number(i) && letter(i + 1))
                                   : (s[i].c == ' ' && letter(i + 1))) {
        k = i + 1;
      }
      if (letter(k)) {
        while (letter(k)) ++k;
        j = k;
      }
    }
    // \p{N}{1,max}  or  ` ?\p{N}+`
    if (j == i) {
      if (max_digits > 0) {
        while (number(j) && j - i < size_t(max_digits)) ++j;
      } else {
        size_t k = s[i].c == ' ' && number(i + 1) ? i + 1 : i;
        if (number(k)) {
          while (number(k)) ++k;
          j = k;
        }
      }
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    if (j == i) {
      size_t k = s[i].c == ' ' && other(i + 1) ? i + 1 : i;
      if (other(k)) {
        while (other(k)) ++k;
        if (punctuation_takes_newlines) {
          while (k < n && IsNewline(s[k].c)) ++k;
        }
        j = k;
      }
    }
    if (j == i && ws(i)) {
      size_t end = i;
      while (ws(end)) ++end;
      // \s*[\r\n]+: the run up to its last newline (the greedy \s* gives back
      // only what [\r\n]+ needs).
      if (newline_runs) {
        for (size_t k = end; k > i; --k) {
          if (IsNewline(s[k - 1].c)) {
            j = k;
            break;
          }
        }
      }
      // \s+(?!\S): the run, less its last character when text follows it.
      if (j == i) {
        if (end == n) j = end;
        else if (end - i >= 2) j = end - 1;
        else j = end;  // \s+
      }
    }
    // Every character is a letter, a number, whitespace or other, so one of
    // the branches matched; this keeps a bug from looping forever.
    if (j == i) j = i + 1;
    emit(i, j);
    i = j;
  }
}

const std::array<std::string, 256>& ByteLevelAlphabet() {
  static const std::array<std::string, 256> alphabet = [] {
    std::array<std::string, 256> a;
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      unicode::AppendUtf8(printable ? char32_t(b) : next++, &a[b]);
    }
    return a;
  }();
  return alphabet;
}

}  // namespace estuary::models
