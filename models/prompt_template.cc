#include "models/prompt_template.h"

#include <fmt/format.h>

#include <utility>

namespace estuary::models {
namespace {

// Stanford Alpaca's train.py, PROMPT_DICT.
constexpr std::string_view kAlpacaWithInput =
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{}\n\n### Input:\n{}\n\n### Response:";
constexpr std::string_view kAlpacaWithoutInput =
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{}\n\n### Response:";

// Jinja's `trim` (Python's str.strip() on ASCII whitespace).
std::string_view Trim(std::string_view s) {
  constexpr std::string_view kSpace = " \t\n\r\v\f";
  const size_t first = s.find_first_not_of(kSpace);
  if (first == std::string_view::npos) return {};
  return s.substr(first, s.find_last_not_of(kSpace) - first + 1);
}

// An Alpaca line as the chat it stands for under a chat template.
std::vector<ChatMessage> AsChat(const InstructionExample& example) {
  if (example.kind == InstructionExample::Kind::kChat) return example.messages;
  std::string user = example.instruction;
  if (!example.input.empty()) user += "\n\n" + example.input;
  return {{ChatMessage::Role::kUser, std::move(user)}, {ChatMessage::Role::kAssistant, example.output}};
}

void Add(std::vector<TemplateSegment>& segments, std::string text, bool scored) {
  if (text.empty()) return;
  if (!segments.empty() && segments.back().scored == scored) {
    segments.back().text += text;
  } else {
    segments.push_back({std::move(text), scored});
  }
}

// The special tokens a template writes, which must each be one id.
std::vector<std::string_view> SpecialTokensOf(PromptTemplate t) {
  switch (t) {
    case PromptTemplate::kLlama3: return {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
    case PromptTemplate::kChatMl: return {"<|im_start|>", "<|im_end|>"};
    default: return {};
  }
}

}  // namespace

Result<PromptTemplate> PromptTemplateNamed(std::string_view name) {
  if (name.empty() || name == "none") return PromptTemplate::kNone;
  if (name == "llama3") return PromptTemplate::kLlama3;
  if (name == "chatml") return PromptTemplate::kChatMl;
  if (name == "alpaca") return PromptTemplate::kAlpaca;
  return InvalidArgument("template '{}' is not one of llama3, chatml, alpaca, none", name);
}

std::string_view PromptTemplateName(PromptTemplate t) {
  switch (t) {
    case PromptTemplate::kNone: return "none";
    case PromptTemplate::kLlama3: return "llama3";
    case PromptTemplate::kChatMl: return "chatml";
    case PromptTemplate::kAlpaca: return "alpaca";
  }
  return "?";
}

Result<std::vector<TemplateSegment>> RenderExample(const InstructionExample& example, PromptTemplate t,
                                                   std::string_view bos, std::string_view eos,
                                                   const std::string& file) {
  using Kind = InstructionExample::Kind;
  std::vector<TemplateSegment> segments;
  const bool needs_eos = example.kind == Kind::kText || t == PromptTemplate::kAlpaca;
  if (needs_eos && eos.empty()) {
    return InvalidArgument("{}, line {}: the tokenizer names no eos_token (tokenizer_config.json), which ends a "
                           "{} example", file, example.line, example.kind == Kind::kText ? "text" : "alpaca");
  }
  if (example.kind == Kind::kText) {
    Add(segments, std::string(bos), false);
    Add(segments, example.text + std::string(eos), true);
    return segments;
  }
  switch (t) {
    case PromptTemplate::kNone:
      return InvalidArgument("{}, line {}: a {} example needs a template (llama3, chatml, alpaca)", file,
                             example.line, example.kind == Kind::kChat ? "chat" : "alpaca");
    case PromptTemplate::kAlpaca:
      if (example.kind == Kind::kChat) {
        return InvalidArgument("{}, line {}: the alpaca template takes instruction/output lines, not messages", file,
                               example.line);
      }
      Add(segments, std::string(bos), false);
      Add(segments,
          example.input.empty() ? fmt::format(kAlpacaWithoutInput, example.instruction)
                                : fmt::format(kAlpacaWithInput, example.instruction, example.input),
          false);
      Add(segments, "\n", false);
      Add(segments, example.output + std::string(eos), true);
      return segments;
    case PromptTemplate::kLlama3:
      Add(segments, "<|begin_of_text|>", false);
      for (const ChatMessage& m : AsChat(example)) {
        const bool scored = m.role == ChatMessage::Role::kAssistant;
        Add(segments, fmt::format("<|start_header_id|>{}<|end_header_id|>\n\n", RoleName(m.role)), false);
        Add(segments, fmt::format("{}<|eot_id|>", Trim(m.content)), scored);
      }
      return segments;
    case PromptTemplate::kChatMl:
      for (const ChatMessage& m : AsChat(example)) {
        const bool scored = m.role == ChatMessage::Role::kAssistant;
        Add(segments, fmt::format("<|im_start|>{}\n", RoleName(m.role)), false);
        Add(segments, m.content + "<|im_end|>", scored);
        Add(segments, "\n", false);
      }
      return segments;
  }
  return InvalidArgument("{}, line {}: unknown template", file, example.line);
}

Result<ExampleEncoder> ExampleEncoder::Create(const Tokenizer& tokenizer, PromptTemplate t,
                                              std::string tokenizer_name) {
  for (std::string_view token : SpecialTokensOf(t)) {
    if (!tokenizer.TokenToId(token)) {
      return InvalidArgument("{}: the {} template needs the token '{}', which the tokenizer lacks", tokenizer_name,
                             PromptTemplateName(t), token);
    }
  }
  ExampleEncoder encoder(tokenizer, t);
  if (auto id = tokenizer.bos_id()) encoder.bos_ = tokenizer.IdToToken(*id).value_or("");
  if (auto id = tokenizer.eos_id()) encoder.eos_ = tokenizer.IdToToken(*id).value_or("");
  return encoder;
}

Result<EncodedExample> ExampleEncoder::Encode(const InstructionExample& example, const std::string& file) const {
  ESTUARY_ASSIGN_OR_RETURN(std::vector<TemplateSegment> segments,
                           RenderExample(example, template_, bos_, eos_, file));
  EncodedExample encoded;
  encoded.line = example.line;
  for (const TemplateSegment& segment : segments) {
    const std::vector<int32_t> ids = tokenizer_.Encode(segment.text, /*add_special_tokens=*/false);
    encoded.ids.insert(encoded.ids.end(), ids.begin(), ids.end());
    encoded.scored.insert(encoded.scored.end(), ids.size(), segment.scored ? 1 : 0);
  }
  if (encoded.ids.size() < 2) {
    return InvalidArgument("{}, line {}: {} token(s): an example needs two, a context and a target", file,
                           example.line, encoded.ids.size());
  }
  return encoded;
}

Result<std::vector<EncodedExample>> ExampleEncoder::EncodeAll(const std::vector<InstructionExample>& examples,
                                                              const std::string& file) const {
  std::vector<EncodedExample> encoded;
  encoded.reserve(examples.size());
  for (const InstructionExample& example : examples) {
    ESTUARY_ASSIGN_OR_RETURN(EncodedExample e, Encode(example, file));
    encoded.push_back(std::move(e));
  }
  return encoded;
}

}  // namespace estuary::models
