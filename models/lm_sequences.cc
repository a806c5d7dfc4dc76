#include "models/lm_sequences.h"

#include <algorithm>
#include <random>

#include "base/seed.h"
#include "models/transformer_ops.h"

namespace estuary::models {
namespace {

// Appends one row from `count` (<= seq_len + 1) consecutive tokens of ids and
// their scored flags, padding the rest.
void AddRow(TokenRows& rows, const int32_t* ids, const uint8_t* scored, int count, int32_t pad_id, uint64_t line) {
  const int inputs = std::max(count - 1, 0);
  for (int i = 0; i < rows.seq_len; ++i) {
    const bool real = i < inputs;
    rows.tokens.push_back(real ? ids[i] : pad_id);
    rows.targets.push_back(real && scored[i + 1] ? ids[i + 1] : kIgnoredTarget);
  }
  rows.lengths.push_back(inputs);
  rows.lines.push_back(line);
}

// Whether the example ends with EOS: as its last token, or as its last
// scored one (a chat's final end-of-turn, before the template's newline).
bool EndsWithEos(const EncodedExample& e, int32_t eos_id) {
  if (e.ids.back() == eos_id) return true;
  for (size_t i = e.ids.size(); i-- > 0;) {
    if (e.scored[i]) return e.ids[i] == eos_id;
  }
  return false;
}

}  // namespace

int64_t TokenRows::ScoredTargets() const {
  return int64_t(std::count_if(targets.begin(), targets.end(), [](int32_t t) { return t != kIgnoredTarget; }));
}

TokenRows Pack(std::span<const EncodedExample> examples, int seq_len, int32_t pad_id,
               std::optional<int32_t> eos_id) {
  TokenRows rows;
  rows.seq_len = seq_len;
  std::vector<int32_t> ids;
  std::vector<uint8_t> scored;
  std::vector<uint64_t> line_at;  // the source line of each stream position
  for (const EncodedExample& e : examples) {
    ids.insert(ids.end(), e.ids.begin(), e.ids.end());
    scored.insert(scored.end(), e.scored.begin(), e.scored.end());
    line_at.insert(line_at.end(), e.ids.size(), e.line);
    if (eos_id && !e.ids.empty() && !EndsWithEos(e, *eos_id)) {
      ids.push_back(*eos_id);
      scored.push_back(0);
      line_at.push_back(e.line);
    }
  }
  // Windows of seq_len + 1 tokens starting every seq_len: each token after
  // the first is a target exactly once.
  for (size_t start = 0; start + 1 < ids.size(); start += size_t(seq_len)) {
    const int count = int(std::min(ids.size() - start, size_t(seq_len) + 1));
    AddRow(rows, ids.data() + start, scored.data() + start, count, pad_id, line_at[start]);
  }
  return rows;
}

TokenRows OneExamplePerSequence(std::span<const EncodedExample> examples, int seq_len, int32_t pad_id) {
  TokenRows rows;
  rows.seq_len = seq_len;
  for (const EncodedExample& e : examples) {
    int count = int(std::min(e.ids.size(), size_t(seq_len) + 1));
    if (e.ids.size() > size_t(seq_len) + 1) ++rows.truncated_examples;
    AddRow(rows, e.ids.data(), e.scored.data(), count, pad_id, e.line);
  }
  return rows;
}

void ShuffleExamples(std::vector<EncodedExample>& examples, uint64_t seed) {
  std::mt19937_64 rng(MixSeed(seed, "lm-examples"));
  Shuffle(examples, rng);
}

}  // namespace estuary::models
