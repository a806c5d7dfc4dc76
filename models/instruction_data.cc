#include "models/instruction_data.h"

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace estuary::models {
namespace {

using nlohmann::json;

std::string_view TypeName(const json& value) {
  switch (value.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    default: return "a number";
  }
}

// Errors of one line: "FILE, line N: what".
class LineErrors {
 public:
  LineErrors(const std::string& name, uint64_t line) : name_(name), line_(line) {}
  template <typename... Args>
  Status operator()(fmt::format_string<Args...> format, Args&&... args) const {
    return InvalidArgument("{}, line {}: {}", name_, line_, fmt::format(format, std::forward<Args>(args)...));
  }

 private:
  const std::string& name_;
  uint64_t line_;
};

// The string at object[key], which must be there (unless optional) and be
// non-empty (unless may_be_empty); `where` names it in errors.
Status GetString(const json& object, const char* key, const std::string& where, const LineErrors& error,
                 bool optional, bool may_be_empty, std::string& out) {
  auto it = object.find(key);
  if (it == object.end()) return optional ? Status::Ok() : error("'{}' is missing", where);
  if (!it->is_string()) return error("'{}' is {}, not a string", where, TypeName(*it));
  out = it->get<std::string>();
  if (out.empty() && !may_be_empty) return error("'{}' is empty", where);
  return Status::Ok();
}

Result<ChatMessage::Role> ParseRole(const std::string& role) {
  if (role == "system") return ChatMessage::Role::kSystem;
  if (role == "user") return ChatMessage::Role::kUser;
  if (role == "assistant") return ChatMessage::Role::kAssistant;
  return InvalidArgument("'{}' is not one of system, user, assistant", role);
}

Status ParseChat(const json& object, const LineErrors& error, InstructionExample& example) {
  const json& messages = object["messages"];
  if (!messages.is_array()) return error("'messages' is {}, not an array", TypeName(messages));
  if (messages.empty()) return error("'messages' is empty");
  bool has_assistant = false;
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string where = fmt::format("messages[{}]", i);
    if (!messages[i].is_object()) return error("'{}' is {}, not an object", where, TypeName(messages[i]));
    ChatMessage message;
    std::string role;
    ESTUARY_RETURN_IF_ERROR(GetString(messages[i], "role", where + ".role", error, false, false, role));
    auto parsed = ParseRole(role);
    if (!parsed.ok()) return error("{}.role: {}", where, parsed.status().message());
    message.role = *parsed;
    ESTUARY_RETURN_IF_ERROR(
        GetString(messages[i], "content", where + ".content", error, false, false, message.content));
    has_assistant = has_assistant || message.role == ChatMessage::Role::kAssistant;
    example.messages.push_back(std::move(message));
  }
  if (!has_assistant) return error("'messages' has no assistant message: nothing to score");
  return Status::Ok();
}

Result<InstructionExample> ParseLine(std::string_view line, const LineErrors& error) {
  if (line.find_first_not_of(" \t\r") == std::string_view::npos) {
    return error("blank (a JSON Lines file holds one JSON object on every line)");
  }
  json object;
  try {
    object = json::parse(line);
  } catch (const json::parse_error& e) {
    return error("not JSON (syntax error at byte {})", e.byte);
  }
  if (!object.is_object()) return error("{}, not a JSON object", TypeName(object));
  const bool text = object.contains("text"), chat = object.contains("messages");
  const bool alpaca = object.contains("instruction") || object.contains("output");
  if (int(text) + int(chat) + int(alpaca) != 1) {
    if (!text && !chat && !alpaca) return error("none of 'text', 'instruction' and 'output', 'messages' is there");
    return error("holds more than one of 'text', 'instruction' and 'output', 'messages'");
  }
  InstructionExample example;
  if (text) {
    example.kind = InstructionExample::Kind::kText;
    ESTUARY_RETURN_IF_ERROR(GetString(object, "text", "text", error, false, false, example.text));
  } else if (alpaca) {
    example.kind = InstructionExample::Kind::kAlpaca;
    ESTUARY_RETURN_IF_ERROR(GetString(object, "instruction", "instruction", error, false, false, example.instruction));
    ESTUARY_RETURN_IF_ERROR(GetString(object, "input", "input", error, true, true, example.input));
    ESTUARY_RETURN_IF_ERROR(GetString(object, "output", "output", error, false, false, example.output));
  } else {
    example.kind = InstructionExample::Kind::kChat;
    ESTUARY_RETURN_IF_ERROR(ParseChat(object, error, example));
  }
  return example;
}

}  // namespace

std::string_view RoleName(ChatMessage::Role role) {
  switch (role) {
    case ChatMessage::Role::kSystem: return "system";
    case ChatMessage::Role::kUser: return "user";
    case ChatMessage::Role::kAssistant: return "assistant";
  }
  return "?";
}

Result<std::vector<InstructionExample>> ParseInstructionJsonl(std::string_view text, const std::string& name) {
  std::vector<InstructionExample> examples;
  uint64_t number = 0;
  while (!text.empty()) {
    const size_t end = text.find('\n');
    std::string_view line = text.substr(0, end);
    text = end == std::string_view::npos ? std::string_view() : text.substr(end + 1);
    ++number;
    ESTUARY_ASSIGN_OR_RETURN(InstructionExample example, ParseLine(line, LineErrors(name, number)));
    example.line = number;
    examples.push_back(std::move(example));
  }
  if (examples.empty()) return InvalidArgument("{}: no examples (the file is empty)", name);
  return examples;
}

Result<std::vector<InstructionExample>> LoadInstructionJsonl(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return IoError("{}: cannot open", file.string());
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return IoError("{}: cannot read", file.string());
  return ParseInstructionJsonl(text.view(), file.string());
}

}  // namespace estuary::models
