// Prompt templates: how an instruction example (models/instruction_data.h)
// becomes the text a model is trained on, and which of its tokens the loss
// scores. Built in, by name:
//
//   llama3  Meta's Llama 3 chat format, as its tokenizer_config.json's
//           chat_template renders it: <|begin_of_text|>, then for each message
//           <|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|>, the
//           content trimmed of surrounding whitespace (the Jinja's `| trim`).
//   chatml  <|im_start|>ROLE\nCONTENT<|im_end|>\n for each message, as Qwen's
//           templates render system and user turns (no default system
//           message, no <think> block).
//   alpaca  Stanford Alpaca's prompt (train.py's PROMPT_DICT, with or
//           without input), a newline, then the output: BOS + prompt +
//           "\n" + OUTPUT + EOS, as alpaca-lora lays it out.
//
// Scored (the loss's targets) are each assistant message's content and its
// end token (<|eot_id|>, <|im_end|>), or Alpaca's output and EOS; the rest —
// BOS, headers, system and user turns, the prompt — is context only. An
// Alpaca line under llama3 or chatml is the chat [user: instruction, or
// instruction + "\n\n" + input; assistant: output]; a chat line under alpaca
// is refused. {"text"} lines take no template: BOS (when the tokenizer has
// one) + text + EOS, every token after BOS scored.
//
// Each segment (scored or not) is tokenized on its own, so no token straddles
// prompt and response; the cuts fall on special tokens and newlines, where a
// byte-level BPE (Llama 3, Qwen: tested) gives the whole text's ids; a
// SentencePiece tokenizer prepends its "▁" to each. Special-token strings inside
// a message are read as those tokens, as Hugging Face's apply_chat_template
// does.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "models/instruction_data.h"
#include "models/tokenizer.h"

namespace estuary::models {

enum class PromptTemplate { kNone, kLlama3, kChatMl, kAlpaca };

// "llama3", "chatml", "alpaca", or "" / "none" (text lines only).
Result<PromptTemplate> PromptTemplateNamed(std::string_view name);
std::string_view PromptTemplateName(PromptTemplate t);

struct TemplateSegment {
  std::string text;
  bool scored = false;
};

// The example's text as consecutive segments. `bos` and `eos` are the
// tokenizer's BOS and EOS strings ("" when it has none). Fails, naming the
// line, on a chat or Alpaca line without a template, a chat line under alpaca,
// or a missing EOS where one is needed.
Result<std::vector<TemplateSegment>> RenderExample(const InstructionExample& example, PromptTemplate t,
                                                   std::string_view bos, std::string_view eos,
                                                   const std::string& file);

// Token ids and, for each, whether the loss scores it (as the target
// predicted from the token before it).
struct EncodedExample {
  std::vector<int32_t> ids;
  std::vector<uint8_t> scored;
  uint64_t line = 0;
};

// Checks that the tokenizer holds the template's special tokens as single
// ids (one line naming the token otherwise), renders and tokenizes.
class ExampleEncoder {
 public:
  static Result<ExampleEncoder> Create(const Tokenizer& tokenizer, PromptTemplate t, std::string tokenizer_name);
  // `file` names the data file in errors.
  Result<EncodedExample> Encode(const InstructionExample& example, const std::string& file) const;
  Result<std::vector<EncodedExample>> EncodeAll(const std::vector<InstructionExample>& examples,
                                                const std::string& file) const;

 private:
  ExampleEncoder(const Tokenizer& tokenizer, PromptTemplate t) : tokenizer_(tokenizer), template_(t) {}
  Tokenizer tokenizer_;
  PromptTemplate template_;
  std::string bos_, eos_;
};

}  // namespace estuary::models
