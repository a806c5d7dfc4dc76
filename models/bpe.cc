#include "models/bpe.h"

#include <fmt/format.h>

#include <algorithm>
#include <queue>

#include "models/pretokenizer.h"
#include "models/unicode.h"

namespace estuary::models {

std::optional<std::string> Bpe::ModelSpelling(std::string_view token) const {
  if (!options_.byte_level) return std::string(token);
  std::string bytes;
  for (size_t at = 0; at < token.size();) {
    const size_t start = at;
    unicode::NextCodePoint(token, &at);
    auto it = byte_of_char_.find(std::string(token.substr(start, at - start)));
    // A token outside the alphabet can never be formed from bytes.
    if (it == byte_of_char_.end()) return std::nullopt;
    bytes.push_back(it->second);
  }
  return bytes;
}

Status Bpe::AddToken(std::string_view token, int32_t id) {
  if (options_.byte_level && byte_of_char_.empty()) {
    const auto& alphabet = ByteLevelAlphabet();
    for (int b = 0; b < 256; ++b) byte_of_char_[alphabet[b]] = char(b);
  }
  std::optional<std::string> spelling = ModelSpelling(token);
  if (!spelling) return Status::Ok();
  if (!vocab_.emplace(*spelling, id).second) return InvalidArgument("token '{}' appears twice", std::string(token));
  return Status::Ok();
}

Status Bpe::AddMerge(std::string_view left, std::string_view right) {
  std::optional<std::string> a = ModelSpelling(left), b = ModelSpelling(right);
  std::optional<int32_t> a_id = a ? Find(*a) : std::nullopt, b_id = b ? Find(*b) : std::nullopt;
  if (!a_id) return InvalidArgument("merge '{} {}': '{}' is not a token", left, right, left);
  if (!b_id) return InvalidArgument("merge '{} {}': '{}' is not a token", left, right, right);
  std::optional<int32_t> merged = Find(*a + *b);
  if (!merged) return InvalidArgument("merge '{} {}': '{}{}' is not a token", left, right, left, right);
  // A pair listed twice keeps its first (lowest) rank.
  merges_.emplace(PairKey(*a_id, *b_id), Merge{int32_t(merges_.size()), *merged});
  return Status::Ok();
}

Status Bpe::Finish() {
  std::fill(std::begin(byte_ids_), std::end(byte_ids_), -1);
  std::fill(std::begin(fallback_ids_), std::end(fallback_ids_), -1);
  for (int b = 0; b < 256; ++b) {
    if (options_.byte_level) {
      std::optional<int32_t> id = Find(std::string(1, char(b)));
      if (!id) return InvalidArgument("the byte-level vocabulary has no token for byte 0x{:02X}", b);
      byte_ids_[b] = *id;
    }
    if (options_.byte_fallback) fallback_ids_[b] = Find(fmt::format("<0x{:02X}>", b)).value_or(-1);
  }
  return Status::Ok();
}

std::optional<int32_t> Bpe::Find(std::string_view token) const {
  auto it = vocab_.find(std::string(token));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

void Bpe::InitialSymbols(std::string_view word, std::vector<int32_t>* symbols) const {
  if (options_.byte_level) {
    for (char c : word) symbols->push_back(byte_ids_[uint8_t(c)]);
    return;
  }
  bool unk_pending = false;  // the last symbol is an unknown that may absorb the next (fuse_unk)
  for (size_t at = 0; at < word.size();) {
    const size_t start = at;
    unicode::NextCodePoint(word, &at);
    const std::string_view ch = word.substr(start, at - start);
    if (std::optional<int32_t> id = Find(ch)) {
      symbols->push_back(*id);
      unk_pending = false;
      continue;
    }
    if (options_.byte_fallback &&
        std::all_of(ch.begin(), ch.end(), [&](char c) { return fallback_ids_[uint8_t(c)] >= 0; })) {
      for (char c : ch) symbols->push_back(fallback_ids_[uint8_t(c)]);
      unk_pending = false;
      continue;
    }
    if (!options_.unk_id) continue;
    if (!(unk_pending && options_.fuse_unk)) symbols->push_back(*options_.unk_id);
    unk_pending = true;
  }
}

void Bpe::Encode(std::string_view word, std::vector<int32_t>* ids) const {
  if (word.empty()) return;
  if (options_.ignore_merges) {
    if (std::optional<int32_t> id = Find(word)) {
      ids->push_back(*id);
      return;
    }
  }
  std::vector<int32_t> symbols;
  symbols.reserve(word.size());
  InitialSymbols(word, &symbols);
  const int n = int(symbols.size());
  if (n < 2) {
    ids->insert(ids->end(), symbols.begin(), symbols.end());
    return;
  }
  // A doubly linked list over the symbols; a merge empties the right one.
  std::vector<int> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (int i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  // Candidates by (rank, position), lowest first; a popped candidate whose
  // symbols have changed since is stale and skipped.
  struct Candidate {
    int32_t rank;
    int pos;
    int32_t id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  const auto consider = [&](int i) {
    if (i < 0 || next[i] < 0) return;
    auto it = merges_.find(PairKey(symbols[i], symbols[next[i]]));
    if (it != merges_.end()) queue.push({it->second.rank, i, it->second.id});
  };
  for (int i = 0; i + 1 < n; ++i) consider(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    const int i = top.pos;
    if (!alive[i] || next[i] < 0) continue;
    auto it = merges_.find(PairKey(symbols[i], symbols[next[i]]));
    if (it == merges_.end() || it->second.id != top.id) continue;
    const int right = next[i];
    symbols[i] = top.id;
    alive[right] = false;
    next[i] = next[right];
    if (next[i] >= 0) prev[next[i]] = i;
    consider(prev[i]);
    consider(i);
  }
  for (int i = 0; i >= 0; i = next[i]) ids->push_back(symbols[i]);
}

}  // namespace estuary::models
