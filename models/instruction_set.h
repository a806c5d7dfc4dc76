// Instruction data, a site's or the server's held-out set: the examples of a
// JSON Lines file (models/instruction_data.h) rendered with a prompt template
// and tokenized once at load (models/prompt_template.h), then packed into rows
// of the task's sequence length (models/lm_sequences.h).
//
// Targets the template does not score (BOS, role headers, system and user
// turns, the Alpaca prompt, padding) are -100; the loss is the mean over the
// scored targets of a whole global batch, as PyTorch's cross_entropy with
// ignore_index=-100. A site of N ranks weights rank r's gradient by its
// scored targets over the batch's (client/rank_trainer.h): every rank holds
// the site's rows and walks the same schedule, so each counts the global
// batch's scored targets itself and the N ranks give one process's gradient.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "models/instruction_data.h"
#include "models/lm_sequences.h"
#include "models/prompt_template.h"
#include "models/tokenizer.h"

namespace estuary::models {

struct InstructionSet {
  std::string file;                         // what errors call the data file
  PromptTemplate prompt_template = PromptTemplate::kNone;
  std::vector<EncodedExample> examples;
  int32_t pad_id = 0;                       // the tokenizer's pad, else its EOS, else 0 (never a target)
  std::optional<int32_t> eos_id;            // the tokenizer's
  int32_t vocab_size = 0;                   // the tokenizer's: the model's must hold it
  uint64_t scored_tokens = 0;               // over every example: the site's weight in the average

  std::string_view template_name() const { return PromptTemplateName(prompt_template); }
};

// Reads `data` (JSON Lines) and `tokenizer` (a tokenizer.json, with the
// tokenizer_config.json beside it), renders every example with the template
// named `template_name` and tokenizes it. Each failure is one line: an
// unknown template lists the known ones, a malformed line names file and
// line, a template the tokenizer cannot render names the missing token.
Result<InstructionSet> LoadInstructionSet(const std::filesystem::path& data, const std::filesystem::path& tokenizer,
                                          std::string_view template_name);
// The same from examples already read (a simulated site's share of a file);
// `file` is what errors call their source.
Result<InstructionSet> EncodeInstructionSet(const std::vector<InstructionExample>& examples,
                                            const Tokenizer& tokenizer, PromptTemplate t,
                                            std::string file);

// The set packed into rows of seq_len (Pack, in file order; the
// trainer's schedule shuffles the rows), with each row's scored targets.
struct TrainingRows {
  TokenRows rows;
  std::vector<uint32_t> scored;  // per row: its targets other than -100
};
TrainingRows PackForTraining(const InstructionSet& set, int seq_len);

}  // namespace estuary::models
