// Encoded examples (models/prompt_template.h) laid out as training rows for
// Llama::ForwardBackward: rows of seq_len inputs and seq_len targets, where
// targets[i] is the token after inputs[i] when the loss scores it and -100
// (kIgnoredTarget) when not. Two layouts:
//
//   Pack                   the examples back to back, each ending with EOS,
//                          cut into windows of seq_len + 1 tokens that
//                          overlap by one (inputs, and the same shifted by one
//                          as targets); nothing is lost, attention runs across
//                          example boundaries, and the last row is padded.
//                          Text and Alpaca examples end with EOS already, and
//                          so does a chat whose end-of-turn token is the EOS
//                          (Qwen's <|im_end|>); after any other (a Llama 3
//                          turn's <|eot_id|> under a base config's
//                          <|end_of_text|>) Pack adds EOS, unscored: it marks
//                          the boundary without being taught.
//   OneExamplePerSequence  each example its own row, padded with pad_id
//                          (targets -100) or cut to seq_len + 1 tokens, the
//                          cut ones counted.
//
// ShuffleExamples orders examples by a seed (base/seed.h's draws): the same
// seed gives the same order on every platform.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "models/prompt_template.h"

namespace estuary::models {

struct TokenRows {
  int seq_len = 0;
  std::vector<int32_t> tokens;   // rows() x seq_len
  std::vector<int32_t> targets;  // rows() x seq_len
  std::vector<int> lengths;      // per row: the positions before any padding
  std::vector<uint64_t> lines;   // per row: the source line of its (first) example
  int64_t truncated_examples = 0;

  int64_t rows() const { return seq_len > 0 ? int64_t(tokens.size()) / seq_len : 0; }
  // Targets other than -100, over every row.
  int64_t ScoredTargets() const;
};

// eos_id: the tokenizer's (nullopt: none is added).
TokenRows Pack(std::span<const EncodedExample> examples, int seq_len, int32_t pad_id,
               std::optional<int32_t> eos_id);
TokenRows OneExamplePerSequence(std::span<const EncodedExample> examples, int seq_len, int32_t pad_id);
void ShuffleExamples(std::vector<EncodedExample>& examples, uint64_t seed);

}  // namespace estuary::models
