// Fine-tuning data for the language models: JSON Lines files whose every line
// is one example, in one of three forms Hugging Face datasets use:
//
//   {"text": "..."}                                          plain text, every token scored
//   {"instruction": "...", "input": "...", "output": "..."}  Stanford Alpaca ("input" optional)
//   {"messages": [{"role": "user", "content": "..."}, ...]}  a chat (system, user, assistant)
//
// Other keys on a line are ignored (datasets carry ids and sources). Every
// string that is there must be non-empty, except Alpaca's "input", and a chat
// needs an assistant message (something to score). A line that breaks any of
// this, or is blank or not a JSON object, fails the whole load with one line
// naming the file, the line number, the field and what is wrong
// ("train.jsonl, line 7: messages[2].role: 'tool' is not one of system, user,
// assistant"): nothing is skipped.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace estuary::models {

struct ChatMessage {
  enum class Role { kSystem, kUser, kAssistant };
  Role role = Role::kUser;
  std::string content;
};
std::string_view RoleName(ChatMessage::Role role);

struct InstructionExample {
  enum class Kind { kText, kAlpaca, kChat };
  Kind kind = Kind::kText;
  std::string text;                        // kText
  std::string instruction, input, output;  // kAlpaca; input may be empty
  std::vector<ChatMessage> messages;       // kChat
  uint64_t line = 0;                       // where it came from, counting from 1
};

// `name` is what errors call the file.
Result<std::vector<InstructionExample>> ParseInstructionJsonl(std::string_view text, const std::string& name);
Result<std::vector<InstructionExample>> LoadInstructionJsonl(const std::filesystem::path& file);

}  // namespace estuary::models
