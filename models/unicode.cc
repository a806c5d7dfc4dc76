#include "models/unicode.h"

#include <algorithm>
#include <iterator>

namespace estuary::models::unicode {
namespace {

struct CategoryRange { char32_t first, last; uint8_t cls; };
struct CombiningRange { char32_t first, last; uint8_t ccc; };
struct Decomposition { char32_t cp, first, second; };
struct Composition { char32_t first, second, composite; };

#include "models/unicode_tables.inc"

template <typename Range>
const Range* FindRange(const Range* begin, const Range* end, char32_t c) {
  const Range* it = std::upper_bound(begin, end, c, [](char32_t v, const Range& r) { return v < r.first; });
  if (it == begin) return nullptr;
  --it;
  return c <= it->last ? it : nullptr;
}

uint8_t CombiningClass(char32_t c) {
  if (c < 0x300) return 0;
  const CombiningRange* r = FindRange(std::begin(kCombiningClasses), std::end(kCombiningClasses), c);
  return r ? r->ccc : 0;
}

// Hangul syllables compose and decompose by arithmetic (Unicode §3.12).
constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

void Decompose(char32_t c, std::u32string* out) {
  if (c >= kSBase && c < kSBase + kSCount) {
    const char32_t s = c - kSBase;
    out->push_back(kLBase + s / kNCount);
    out->push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount) out->push_back(kTBase + s % kTCount);
    return;
  }
  if (c >= 0xC0) {
    auto it = std::lower_bound(std::begin(kDecompositions), std::end(kDecompositions), c,
                               [](const Decomposition& d, char32_t v) { return d.cp < v; });
    if (it != std::end(kDecompositions) && it->cp == c) {
      Decompose(it->first, out);
      if (it->second) Decompose(it->second, out);
      return;
    }
  }
  out->push_back(c);
}

// The primary composite of a + b, or 0.
char32_t Compose(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount) {
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  }
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase && b < kTBase + kTCount) {
    return a + (b - kTBase);
  }
  auto it = std::lower_bound(std::begin(kCompositions), std::end(kCompositions), std::pair(a, b),
                             [](const Composition& c, std::pair<char32_t, char32_t> v) {
                               return std::pair(c.first, c.second) < v;
                             });
  return it != std::end(kCompositions) && it->first == a && it->second == b ? it->composite : 0;
}

}  // namespace

const char* TablesVersion() { return kUnicodeVersion; }

uint8_t ClassOf(char32_t c) {
  const CategoryRange* r = FindRange(std::begin(kCategoryRanges), std::end(kCategoryRanges), c);
  return r ? r->cls : 0;
}

bool IsWhitespace(char32_t c) {
  if (c <= 0x20) return c == 0x20 || (c >= 0x09 && c <= 0x0D);
  if (c < 0x85) return false;
  return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
         c == 0x202F || c == 0x205F || c == 0x3000;
}

namespace {

// The length of the valid sequence at text[i], or 0 with *bad set to the
// length of the maximal invalid subpart there (Unicode §3.9, table 3-7).
size_t SequenceAt(std::string_view text, size_t i, size_t* bad) {
  const auto b = [&](size_t k) { return uint8_t(text[k]); };
  const uint8_t lead = b(i);
  if (lead < 0x80) return 1;
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) need = 1;
  else if (lead >= 0xE0 && lead <= 0xEF) {
    need = 2;
    if (lead == 0xE0) lo = 0xA0;
    if (lead == 0xED) hi = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    need = 3;
    if (lead == 0xF0) lo = 0x90;
    if (lead == 0xF4) hi = 0x8F;
  } else {
    *bad = 1;
    return 0;
  }
  for (size_t k = 1; k <= need; ++k) {
    const bool ok = i + k < text.size() && b(i + k) >= (k == 1 ? lo : 0x80) && b(i + k) <= (k == 1 ? hi : 0xBF);
    if (!ok) {
      *bad = k;
      return 0;
    }
  }
  return need + 1;
}

}  // namespace

bool Utf8Valid(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    if (uint8_t(text[i]) < 0x80) {
      ++i;
      continue;
    }
    size_t bad = 0, n = SequenceAt(text, i, &bad);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string ReplaceInvalidUtf8(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 8);
  for (size_t i = 0; i < text.size();) {
    size_t bad = 0, n = SequenceAt(text, i, &bad);
    if (n) {
      out.append(text.substr(i, n));
      i += n;
    } else {
      AppendUtf8(kReplacement, &out);
      i += bad;
    }
  }
  return out;
}

char32_t NextCodePoint(std::string_view text, size_t* at) {
  const auto b = [&](size_t k) { return char32_t(uint8_t(text[k])); };
  size_t i = *at;
  const char32_t lead = b(i);
  if (lead < 0x80) {
    *at = i + 1;
    return lead;
  }
  if (lead < 0xE0) {
    *at = i + 2;
    return (lead & 0x1F) << 6 | (b(i + 1) & 0x3F);
  }
  if (lead < 0xF0) {
    *at = i + 3;
    return (lead & 0x0F) << 12 | (b(i + 1) & 0x3F) << 6 | (b(i + 2) & 0x3F);
  }
  *at = i + 4;
  return (lead & 0x07) << 18 | (b(i + 1) & 0x3F) << 12 | (b(i + 2) & 0x3F) << 6 | (b(i + 3) & 0x3F);
}

void AppendUtf8(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(char(c));
  } else if (c < 0x800) {
    out->push_back(char(0xC0 | c >> 6));
    out->push_back(char(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(char(0xE0 | c >> 12));
    out->push_back(char(0x80 | (c >> 6 & 0x3F)));
    out->push_back(char(0x80 | (c & 0x3F)));
  } else {
    out->push_back(char(0xF0 | c >> 18));
    out->push_back(char(0x80 | (c >> 12 & 0x3F)));
    out->push_back(char(0x80 | (c >> 6 & 0x3F)));
    out->push_back(char(0x80 | (c & 0x3F)));
  }
}

std::string Nfc(std::string_view text) {
  // Below U+0300 nothing decomposes into anything that would not compose
  // back, and nothing combines: most text leaves here untouched.
  size_t at = 0;
  bool plain = true;
  for (size_t i = 0; i < text.size() && plain;) plain = NextCodePoint(text, &i) < 0x300;
  if (plain) return std::string(text);

  std::u32string cps;
  while (at < text.size()) Decompose(NextCodePoint(text, &at), &cps);
  // Canonical order: a stable sort of each run of non-starters by class.
  for (size_t i = 0; i < cps.size();) {
    if (CombiningClass(cps[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < cps.size() && CombiningClass(cps[j]) != 0) ++j;
    std::stable_sort(cps.begin() + i, cps.begin() + j,
                     [](char32_t a, char32_t b) { return CombiningClass(a) < CombiningClass(b); });
    i = j;
  }
  // Canonical composition: each character joins the last starter unless a
  // character between them blocks it (same or higher class, or a starter).
  std::u32string out;
  size_t starter = std::u32string::npos;
  int last_class = -1;
  for (char32_t c : cps) {
    const int ccc = CombiningClass(c);
    if (starter != std::u32string::npos && (last_class < ccc || (last_class == 0 && out.size() == starter + 1))) {
      if (char32_t composite = Compose(out[starter], c)) {
        out[starter] = composite;
        continue;
      }
    }
    if (ccc == 0) starter = out.size();
    last_class = ccc;
    out.push_back(c);
  }
  std::string result;
  result.reserve(text.size());
  for (char32_t c : out) AppendUtf8(c, &result);
  return result;
}

}  // namespace estuary::models::unicode
