// Instruction data: the JSONL loader and its one-line errors, the prompt
// templates against the chat_template of the real Llama 3 and Qwen 3
// tokenizer_config.json files (the expected strings rendered by hand from the
// Jinja; the ids from the real tokenizers), and packing.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>

#include "models/instruction_data.h"
#include "models/lm_sequences.h"
#include "models/prompt_template.h"
#include "models/tokenizer.h"
#include "models/transformer_ops.h"

namespace estuary::models {
namespace {

namespace fs = std::filesystem;
const fs::path kTokenizers = fs::path(ESTUARY_BINARY_DIR) / "tests/models/tokenizer/tokenizers";

// ------------------------------------------------------------------ loader

TEST(InstructionJsonl, ReadsTheThreeForms) {
  auto examples = ParseInstructionJsonl(
      R"({"text": "plain", "id": 7}
{"instruction": "Add.", "input": "2 2", "output": "4"}
{"instruction": "Greet.", "output": "Hi"}
{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
)",
      "d.jsonl");
  ASSERT_TRUE(examples.ok()) << examples.status().ToString();
  ASSERT_EQ(examples->size(), 4u);
  EXPECT_EQ((*examples)[0].kind, InstructionExample::Kind::kText);
  EXPECT_EQ((*examples)[0].text, "plain");
  EXPECT_EQ((*examples)[1].kind, InstructionExample::Kind::kAlpaca);
  EXPECT_EQ((*examples)[1].input, "2 2");
  EXPECT_EQ((*examples)[2].input, "");
  EXPECT_EQ((*examples)[2].output, "Hi");
  ASSERT_EQ((*examples)[3].messages.size(), 3u);
  EXPECT_EQ((*examples)[3].messages[2].role, ChatMessage::Role::kAssistant);
  EXPECT_EQ((*examples)[3].messages[2].content, "Hello");
  EXPECT_EQ((*examples)[3].line, 4u);
}

// Each bad line fails the load with one line naming file, line and fault;
// the good line before it does not hide it.
TEST(InstructionJsonl, EveryMalformedLineGetsOneLineNamingFileLineAndFault) {
  const std::string good = R"({"text": "ok"})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"text": "unterminated)", "d.jsonl, line 2: not JSON (syntax error at byte 23)"},
      {R"([1, 2])", "d.jsonl, line 2: an array, not a JSON object"},
      {"", "d.jsonl, line 2: blank (a JSON Lines file holds one JSON object on every line)"},
      {R"({"prompt": "x"})", "d.jsonl, line 2: none of 'text', 'instruction' and 'output', 'messages' is there"},
      {R"({"text": "x", "messages": []})",
       "d.jsonl, line 2: holds more than one of 'text', 'instruction' and 'output', 'messages'"},
      {R"({"text": 3})", "d.jsonl, line 2: 'text' is a number, not a string"},
      {R"({"text": ""})", "d.jsonl, line 2: 'text' is empty"},
      {R"({"instruction": "x"})", "d.jsonl, line 2: 'output' is missing"},
      {R"({"output": "x"})", "d.jsonl, line 2: 'instruction' is missing"},
      {R"({"instruction": "x", "input": null, "output": "y"})", "d.jsonl, line 2: 'input' is null, not a string"},
      {R"({"messages": {}})", "d.jsonl, line 2: 'messages' is an object, not an array"},
      {R"({"messages": []})", "d.jsonl, line 2: 'messages' is empty"},
      {R"({"messages": ["hi"]})", "d.jsonl, line 2: 'messages[0]' is a string, not an object"},
      {R"({"messages": [{"content": "hi"}]})", "d.jsonl, line 2: 'messages[0].role' is missing"},
      {R"({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]})",
       "d.jsonl, line 2: messages[1].role: 'tool' is not one of system, user, assistant"},
      {R"({"messages": [{"role": "user", "content": ""}]})", "d.jsonl, line 2: 'messages[0].content' is empty"},
      {R"({"messages": [{"role": "user", "content": "a"}]})",
       "d.jsonl, line 2: 'messages' has no assistant message: nothing to score"},
  };
  for (const auto& [line, message] : cases) {
    auto r = ParseInstructionJsonl(good + "\n" + line + "\n" + good + "\n", "d.jsonl");
    ASSERT_FALSE(r.ok()) << line;
    EXPECT_EQ(r.status().message(), message) << line;
    EXPECT_EQ(r.status().message().find('\n'), std::string::npos);
  }
  EXPECT_EQ(ParseInstructionJsonl("", "e.jsonl").status().message(), "e.jsonl: no examples (the file is empty)");
  auto missing = LoadInstructionJsonl("/nonexistent/d.jsonl");
  EXPECT_EQ(missing.status().message(), "/nonexistent/d.jsonl: cannot open");
}

// --------------------------------------------------------------- templates

struct Loaded {
  Tokenizer tokenizer;
  std::string chat_template;
};

Loaded LoadTokenizer(const std::string& name) {
  auto tokenizer = Tokenizer::Load(kTokenizers / name / "tokenizer.json");
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  std::ifstream in(kTokenizers / name / "tokenizer_config.json");
  const auto config = nlohmann::json::parse(in);
  return {std::move(tokenizer).value(), config.value("chat_template", std::string())};
}

InstructionExample Chat(std::vector<ChatMessage> messages) {
  InstructionExample e;
  e.kind = InstructionExample::Kind::kChat;
  e.messages = std::move(messages);
  e.line = 1;
  return e;
}

std::string Joined(const std::vector<TemplateSegment>& segments, bool scored_only) {
  std::string out;
  for (const auto& s : segments) {
    if (!scored_only || s.scored) out += s.text;
  }
  return out;
}

// The scored ids decode to exactly `expected`; the ids are those of the whole
// text tokenized at once (the segment cuts change nothing).
void ExpectEncoding(const Tokenizer& tokenizer, const EncodedExample& encoded, const std::string& text,
                    const std::string& expected_scored) {
  EXPECT_EQ(encoded.ids, tokenizer.Encode(text, false));
  std::vector<int32_t> scored;
  for (size_t i = 0; i < encoded.ids.size(); ++i) {
    if (encoded.scored[i]) scored.push_back(encoded.ids[i]);
  }
  EXPECT_EQ(tokenizer.Decode(scored, false), expected_scored);
}

const InstructionExample kConversation = Chat({{ChatMessage::Role::kSystem, "Be brief."},
                                              {ChatMessage::Role::kUser, " What is 2+2? \n"},
                                              {ChatMessage::Role::kAssistant, "4"},
                                              {ChatMessage::Role::kUser, "And 3+3?"},
                                              {ChatMessage::Role::kAssistant, "6, surely.\n"}});

TEST(PromptTemplate, Llama3IsTheChatTemplateOfLlama3sConfig) {
  Loaded llama3 = LoadTokenizer("llama3");
  // The template's published form: one message, then bos_token before the first.
  ASSERT_NE(llama3.chat_template.find("'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ "
                                      "message['content'] | trim + '<|eot_id|>'"),
            std::string::npos);
  ASSERT_NE(llama3.chat_template.find("{% set content = bos_token + content %}"), std::string::npos);
  // Rendered by hand from it (bos_token is <|begin_of_text|>; contents trimmed).
  const std::string expected =
      "<|begin_of_text|>"
      "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nAnd 3+3?<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n6, surely.<|eot_id|>";
  auto segments = RenderExample(kConversation, PromptTemplate::kLlama3, "<|begin_of_text|>", "<|end_of_text|>", "d");
  ASSERT_TRUE(segments.ok()) << segments.status().ToString();
  EXPECT_EQ(Joined(*segments, false), expected);
  EXPECT_EQ(Joined(*segments, true), "4<|eot_id|>6, surely.<|eot_id|>");

  auto encoder = ExampleEncoder::Create(llama3.tokenizer, PromptTemplate::kLlama3, "llama3");
  ASSERT_TRUE(encoder.ok()) << encoder.status().ToString();
  auto encoded = encoder->Encode(kConversation, "d");
  ASSERT_TRUE(encoded.ok()) << encoded.status().ToString();
  ExpectEncoding(llama3.tokenizer, *encoded, expected, "4<|eot_id|>6, surely.<|eot_id|>");
  // Special tokens are single ids: <|begin_of_text|> 128000, headers 128006/128007, <|eot_id|> 128009.
  EXPECT_EQ(encoded->ids.front(), 128000);
  EXPECT_EQ(encoded->ids.back(), 128009);
  EXPECT_EQ(std::count(encoded->ids.begin(), encoded->ids.end(), 128006), 5);
  EXPECT_EQ(std::count(encoded->ids.begin(), encoded->ids.end(), 128007), 5);
  EXPECT_EQ(std::count(encoded->ids.begin(), encoded->ids.end(), 128009), 5);
  EXPECT_TRUE(encoded->scored.back());
  EXPECT_FALSE(encoded->scored.front());
}

TEST(PromptTemplate, ChatMlIsQwensTurnFormat) {
  Loaded qwen = LoadTokenizer("qwen3");
  // Qwen 3's template renders system and user turns (and the assistant's
  // content, then <|im_end|> and a newline) so.
  ASSERT_NE(qwen.chat_template.find("'<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n'"),
            std::string::npos);
  ASSERT_NE(qwen.chat_template.find("'<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n'"),
            std::string::npos);
  const std::string expected =
      "<|im_start|>system\nBe brief.<|im_end|>\n"
      "<|im_start|>user\n What is 2+2? \n<|im_end|>\n"
      "<|im_start|>assistant\n4<|im_end|>\n"
      "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
      "<|im_start|>assistant\n6, surely.\n<|im_end|>\n";
  auto encoder = ExampleEncoder::Create(qwen.tokenizer, PromptTemplate::kChatMl, "qwen3");
  ASSERT_TRUE(encoder.ok()) << encoder.status().ToString();
  auto segments = RenderExample(kConversation, PromptTemplate::kChatMl, "", "<|im_end|>", "d");
  ASSERT_TRUE(segments.ok());
  EXPECT_EQ(Joined(*segments, false), expected);
  auto encoded = encoder->Encode(kConversation, "d");
  ASSERT_TRUE(encoded.ok()) << encoded.status().ToString();
  ExpectEncoding(qwen.tokenizer, *encoded, expected, "4<|im_end|>6, surely.\n<|im_end|>");
  // <|im_start|> 151644 and <|im_end|> 151645 are single ids; the last newline is context.
  EXPECT_EQ(encoded->ids.front(), 151644);
  EXPECT_EQ(std::count(encoded->ids.begin(), encoded->ids.end(), 151644), 5);
  EXPECT_EQ(std::count(encoded->ids.begin(), encoded->ids.end(), 151645), 5);
  EXPECT_EQ(encoded->ids[encoded->ids.size() - 2], 151645);
  EXPECT_FALSE(encoded->scored.back());
}

TEST(PromptTemplate, AlpacaIsStanfordsPromptWithAndWithoutInput) {
  Loaded llama3 = LoadTokenizer("llama3");
  auto encoder = ExampleEncoder::Create(llama3.tokenizer, PromptTemplate::kAlpaca, "llama3");
  ASSERT_TRUE(encoder.ok());
  InstructionExample with_input;
  with_input.kind = InstructionExample::Kind::kAlpaca;
  with_input.instruction = "Add the numbers.";
  with_input.input = "2 and 2";
  with_input.output = "4";
  InstructionExample without_input = with_input;
  without_input.input.clear();
  const std::string with_text =
      "<|begin_of_text|>Below is an instruction that describes a task, paired with an input that provides further "
      "context. Write a response that appropriately completes the request.\n\n### Instruction:\nAdd the "
      "numbers.\n\n### Input:\n2 and 2\n\n### Response:\n4<|end_of_text|>";
  const std::string without_text =
      "<|begin_of_text|>Below is an instruction that describes a task. Write a response that appropriately "
      "completes the request.\n\n### Instruction:\nAdd the numbers.\n\n### Response:\n4<|end_of_text|>";
  for (const auto& [example, text] : {std::pair{with_input, with_text}, std::pair{without_input, without_text}}) {
    auto segments = RenderExample(example, PromptTemplate::kAlpaca, "<|begin_of_text|>", "<|end_of_text|>", "d");
    ASSERT_TRUE(segments.ok());
    EXPECT_EQ(Joined(*segments, false), text);
    auto encoded = encoder->Encode(example, "d");
    ASSERT_TRUE(encoded.ok()) << encoded.status().ToString();
    ExpectEncoding(llama3.tokenizer, *encoded, text, "4<|end_of_text|>");
    EXPECT_EQ(encoded->ids.back(), 128001);  // <|end_of_text|>, the config's eos_token
  }
  // Under a chat template the same line is one user turn and one assistant turn.
  auto chat = ExampleEncoder::Create(llama3.tokenizer, PromptTemplate::kLlama3, "llama3");
  auto as_chat = chat->Encode(with_input, "d");
  ASSERT_TRUE(as_chat.ok());
  EXPECT_EQ(llama3.tokenizer.Decode(as_chat->ids, false),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nAdd the numbers.\n\n2 and 2<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>");
}

TEST(PromptTemplate, TextLinesTakeNoTemplateAndEndWithEos) {
  Loaded llama3 = LoadTokenizer("llama3");
  auto encoder = ExampleEncoder::Create(llama3.tokenizer, PromptTemplate::kNone, "llama3");
  ASSERT_TRUE(encoder.ok());
  InstructionExample text;
  text.text = "Hello world";
  auto encoded = encoder->Encode(text, "d");
  ASSERT_TRUE(encoded.ok());
  EXPECT_EQ(encoded->ids, (std::vector<int32_t>{128000, 9906, 1917, 128001}));
  EXPECT_EQ(encoded->scored, (std::vector<uint8_t>{0, 1, 1, 1}));
}

TEST(PromptTemplate, MismatchesAreOneLine) {
  Loaded llama3 = LoadTokenizer("llama3");
  EXPECT_EQ(PromptTemplateNamed("vicuna").status().message(),
            "template 'vicuna' is not one of llama3, chatml, alpaca, none");
  EXPECT_EQ(ExampleEncoder::Create(llama3.tokenizer, PromptTemplate::kChatMl, "llama3/tokenizer.json")
                .status()
                .message(),
            "llama3/tokenizer.json: the chatml template needs the token '<|im_start|>', which the tokenizer lacks");
  auto none = ExampleEncoder::Create(llama3.tokenizer, PromptTemplate::kNone, "llama3");
  InstructionExample chat = kConversation;
  chat.line = 9;
  EXPECT_EQ(none->Encode(chat, "d.jsonl").status().message(),
            "d.jsonl, line 9: a chat example needs a template (llama3, chatml, alpaca)");
  auto alpaca = ExampleEncoder::Create(llama3.tokenizer, PromptTemplate::kAlpaca, "llama3");
  EXPECT_EQ(alpaca->Encode(chat, "d.jsonl").status().message(),
            "d.jsonl, line 9: the alpaca template takes instruction/output lines, not messages");
  Loaded qwen = LoadTokenizer("qwen3");  // bos_token null: a text line is its text and EOS (<|im_end|>)
  auto text = ExampleEncoder::Create(qwen.tokenizer, PromptTemplate::kNone, "qwen3");
  InstructionExample hello;
  hello.text = "Hello world";
  auto encoded = text->Encode(hello, "d");
  ASSERT_TRUE(encoded.ok());
  std::vector<int32_t> expected = qwen.tokenizer.Encode("Hello world", false);
  expected.push_back(151645);
  EXPECT_EQ(encoded->ids, expected);
}

// ----------------------------------------------------------------- packing

EncodedExample Example(std::vector<int32_t> ids, std::vector<uint8_t> scored, uint64_t line) {
  return {std::move(ids), std::move(scored), line};
}

constexpr int32_t X = kIgnoredTarget;

TEST(LmSequences, PackingOverlapsWindowsByOneAndCarriesTheMasks) {
  // Three examples: 1 2 3 4 (3 and 4 scored), 5 6 7 (6, 7 scored), 8 9 (9 scored).
  const std::vector<EncodedExample> examples = {Example({1, 2, 3, 4}, {0, 0, 1, 1}, 1),
                                                Example({5, 6, 7}, {0, 1, 1}, 2), Example({8, 9}, {0, 1}, 3)};
  TokenRows rows = Pack(examples, 3, /*pad_id=*/0, /*eos_id=*/std::nullopt);
  ASSERT_EQ(rows.rows(), 3);
  // Windows of 4 tokens from positions 0, 3, 6: 1234, 4567, 789 (padded).
  EXPECT_EQ(rows.tokens, (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8, 0}));
  EXPECT_EQ(rows.targets, (std::vector<int32_t>{X, 3, 4, X, 6, 7, X, 9, X}));
  EXPECT_EQ(rows.lengths, (std::vector<int>{3, 3, 2}));
  EXPECT_EQ(rows.lines, (std::vector<uint64_t>{1, 1, 2}));
  EXPECT_EQ(rows.ScoredTargets(), 5);
  EXPECT_EQ(rows.truncated_examples, 0);
}

// Each packed example ends with EOS (here 9): one that ends with it, as a
// last token or a last scored token, gets none; another gets one, unscored.
TEST(LmSequences, PackingEndsEveryExampleWithEos) {
  const std::vector<EncodedExample> examples = {Example({1, 2, 9}, {0, 1, 1}, 1),     // text: ends with EOS
                                                Example({3, 9, 5}, {0, 1, 0}, 2),     // chatml: EOS, newline
                                                Example({6, 7}, {0, 1}, 3),           // a llama3 turn's end
                                                Example({8, 4}, {0, 1}, 4)};
  TokenRows rows = Pack(examples, 100, /*pad_id=*/0, /*eos_id=*/9);
  ASSERT_EQ(rows.rows(), 1);
  const std::vector<int32_t> stream = {1, 2, 9, 3, 9, 5, 6, 7, 9, 8, 4, 9};
  EXPECT_EQ(std::vector<int32_t>(rows.tokens.begin(), rows.tokens.begin() + 11),
            std::vector<int32_t>(stream.begin(), stream.end() - 1));
  EXPECT_EQ(std::vector<int32_t>(rows.targets.begin(), rows.targets.begin() + 11),
            (std::vector<int32_t>{2, 9, X, 9, X, X, 7, X, X, 4, X}));
  EXPECT_EQ(rows.lengths[0], 11);
}

TEST(LmSequences, OneExamplePerSequencePadsAndCountsWhatItCuts) {
  const std::vector<EncodedExample> examples = {Example({1, 2, 3, 4, 5, 6}, {0, 1, 1, 1, 1, 1}, 1),
                                                Example({7, 8}, {0, 1}, 2)};
  TokenRows rows = OneExamplePerSequence(examples, 3, /*pad_id=*/9);
  ASSERT_EQ(rows.rows(), 2);
  EXPECT_EQ(rows.tokens, (std::vector<int32_t>{1, 2, 3, 7, 9, 9}));
  EXPECT_EQ(rows.targets, (std::vector<int32_t>{2, 3, 4, 8, X, X}));
  EXPECT_EQ(rows.lengths, (std::vector<int>{3, 1}));
  EXPECT_EQ(rows.truncated_examples, 1);
}

TEST(LmSequences, ShufflingIsAPermutationFixedByTheSeed) {
  std::vector<EncodedExample> examples;
  for (uint64_t i = 0; i < 20; ++i) examples.push_back(Example({int32_t(i), 0}, {0, 1}, i));
  auto order = [&](uint64_t seed) {
    std::vector<EncodedExample> copy = examples;
    ShuffleExamples(copy, seed);
    std::vector<uint64_t> lines;
    for (const auto& e : copy) lines.push_back(e.line);
    return lines;
  };
  const std::vector<uint64_t> a = order(5);
  EXPECT_EQ(a, order(5));
  EXPECT_NE(a, order(6));
  std::vector<uint64_t> sorted = a, expected(20);
  std::sort(sorted.begin(), sorted.end());
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(sorted, expected);
}

}  // namespace
}  // namespace estuary::models
