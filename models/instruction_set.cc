#include "models/instruction_set.h"

#include "models/transformer_ops.h"

namespace estuary::models {

Result<InstructionSet> EncodeInstructionSet(const std::vector<InstructionExample>& examples,
                                            const Tokenizer& tokenizer, PromptTemplate t,
                                            std::string file) {
  if (examples.empty()) return InvalidArgument("{}: no examples", file);
  ESTUARY_ASSIGN_OR_RETURN(ExampleEncoder encoder, ExampleEncoder::Create(tokenizer, t, file));
  InstructionSet set;
  ESTUARY_ASSIGN_OR_RETURN(set.examples, encoder.EncodeAll(examples, file));
  set.file = std::move(file);
  set.prompt_template = t;
  set.eos_id = tokenizer.eos_id();
  set.pad_id = tokenizer.pad_id().value_or(tokenizer.eos_id().value_or(0));
  set.vocab_size = tokenizer.vocab_size();
  // What Pack scores at any seq_len: every flag but the stream's first
  // (nothing predicts it); the EOS Pack may add is unscored.
  for (const EncodedExample& e : set.examples) {
    for (uint8_t s : e.scored) set.scored_tokens += s;
  }
  set.scored_tokens -= set.examples.front().scored.front();
  return set;
}

Result<InstructionSet> LoadInstructionSet(const std::filesystem::path& data, const std::filesystem::path& tokenizer,
                                          std::string_view template_name) {
  // The template first: a misspelt name costs no parse of a large file.
  ESTUARY_ASSIGN_OR_RETURN(const PromptTemplate t, PromptTemplateNamed(template_name));
  ESTUARY_ASSIGN_OR_RETURN(const Tokenizer tok, Tokenizer::Load(tokenizer));
  ESTUARY_ASSIGN_OR_RETURN(const auto examples, LoadInstructionJsonl(data));
  return EncodeInstructionSet(examples, tok, t, data.string());
}

TrainingRows PackForTraining(const InstructionSet& set, int seq_len) {
  TrainingRows out;
  out.rows = Pack(set.examples, seq_len, set.pad_id, set.eos_id);
  out.scored.reserve(size_t(out.rows.rows()));
  for (int64_t r = 0; r < out.rows.rows(); ++r) {
    uint32_t n = 0;
    for (int i = 0; i < seq_len; ++i) n += out.rows.targets[size_t(r) * seq_len + i] != kIgnoredTarget;
    out.scored.push_back(n);
  }
  return out;
}

}  // namespace estuary::models
