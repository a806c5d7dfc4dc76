// estuary-lm: language-model utilities on the command line.
//
//   estuary-lm tokenize --tokenizer DIR/tokenizer.json [--add-special-tokens] < text
//       each line of standard input (without its newline) -> a JSON array of ids
//   estuary-lm tokenize --tokenizer DIR/tokenizer.json --decode [--skip-special-tokens] < ids
//       each line a JSON array of ids -> its text
//   estuary-lm score --model DIR --tokenizer FILE --data FILE.jsonl [--template NAME] [--seq-len N]
//       each example of the JSONL file (models/instruction_data.h) one
//       sequence under the template (models/prompt_template.h), cut to N + 1
//       tokens (the model's context by default); its loss over the scored
//       tokens and perplexity, and the total, as JSON on standard output
//
// The tokenizer is Hugging Face's tokenizer.json (models/tokenizer.h), with
// tokenizer_config.json read from beside it when there. Errors are one line
// on stderr, naming the file and the field or the input line; exit 1.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "base/cli.h"
#include "models/instruction_data.h"
#include "models/llama.h"
#include "models/lm_sequences.h"
#include "models/prompt_template.h"
#include "models/tokenizer.h"
#include "models/transformer_ops.h"

namespace {

using namespace estuary;

constexpr std::string_view kProgram = "estuary-lm";

struct TokenizeFlags {
  std::string tokenizer;
  bool add_special_tokens = false;
  bool decode = false;
  bool skip_special_tokens = false;
};

Status Tokenize(const TokenizeFlags& flags) {
  ESTUARY_ASSIGN_OR_RETURN(models::Tokenizer tokenizer, models::Tokenizer::Load(flags.tokenizer));
  std::ios::sync_with_stdio(false);
  std::string line, out;
  for (size_t number = 1; std::getline(std::cin, line); ++number) {
    if (!flags.decode) {
      fmt::format_to(std::back_inserter(out), "[{}]\n", fmt::join(tokenizer.Encode(line, flags.add_special_tokens), ","));
    } else {
      const nlohmann::json ids = nlohmann::json::parse(line, nullptr, false);
      std::vector<int32_t> values;
      bool ok = ids.is_array();
      for (size_t i = 0; ok && i < ids.size(); ++i) {
        ok = ids[i].is_number_integer() && ids[i].get<int64_t>() >= 0 && ids[i].get<int64_t>() <= INT32_MAX;
        if (ok) values.push_back(int32_t(ids[i].get<int64_t>()));
      }
      if (!ok) {
        // What the lines before it gave is written first.
        std::fwrite(out.data(), 1, out.size(), stdout);
        std::fflush(stdout);
        return InvalidArgument("standard input, line {}: not a JSON array of token ids", number);
      }
      out += tokenizer.Decode(values, flags.skip_special_tokens);
      out += '\n';
    }
    if (out.size() > (1 << 16)) {
      std::fwrite(out.data(), 1, out.size(), stdout);
      out.clear();
    }
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  if (std::fflush(stdout) != 0) return IoError("standard output: cannot write");
  return Status::Ok();
}

struct ScoreFlags {
  std::string model, tokenizer, data, template_name;
  int seq_len = 0;  // 0: the model's max_seq_len
};

CLI::App* AddScoreSubcommand(CLI::App& app, ScoreFlags& flags) {
  CLI::App* command = app.add_subcommand("score", "loss and perplexity of a model on instruction data (JSONL)");
  command->add_option("--model", flags.model, "a Hugging Face model directory (config.json, model.safetensors)")
      ->required();
  command->add_option("--tokenizer", flags.tokenizer, "a Hugging Face tokenizer.json")->required();
  command->add_option("--data", flags.data, "a JSONL file of text, Alpaca or chat lines")->required();
  command->add_option("--template", flags.template_name, "llama3, chatml or alpaca (text lines need none)");
  command->add_option("--seq-len", flags.seq_len, "tokens per sequence (0: the model's context)")
      ->check(CLI::NonNegativeNumber);
  return command;
}

// One example per sequence, each scored by Forward and the loss of
// Llama::ForwardBackward (the same function on the same logits), so a
// sequence's loss is the number training reports for it.
Status Score(const ScoreFlags& flags) {
  ESTUARY_ASSIGN_OR_RETURN(models::PromptTemplate prompt_template, models::PromptTemplateNamed(flags.template_name));
  ESTUARY_ASSIGN_OR_RETURN(models::Tokenizer tokenizer, models::Tokenizer::Load(flags.tokenizer));
  ESTUARY_ASSIGN_OR_RETURN(models::Llama model, models::LoadHfCheckpoint(flags.model, 1));
  const models::LlamaConfig& config = model.config();
  if (tokenizer.vocab_size() > config.vocab_size) {
    return InvalidArgument("{}: {} tokens, more than the vocabulary of the model in {} ({})", flags.tokenizer,
                           tokenizer.vocab_size(), flags.model, config.vocab_size);
  }
  const int seq_len = flags.seq_len > 0 ? flags.seq_len : config.max_seq_len;
  if (seq_len > config.max_seq_len) {
    return InvalidArgument("--seq-len {} is longer than the model's context ({}, max_position_embeddings)", seq_len,
                           config.max_seq_len);
  }
  ESTUARY_ASSIGN_OR_RETURN(std::vector<models::InstructionExample> examples, models::LoadInstructionJsonl(flags.data));
  ESTUARY_ASSIGN_OR_RETURN(models::ExampleEncoder encoder,
                           models::ExampleEncoder::Create(tokenizer, prompt_template, flags.tokenizer));
  ESTUARY_ASSIGN_OR_RETURN(std::vector<models::EncodedExample> encoded, encoder.EncodeAll(examples, flags.data));
  const int32_t pad_id = tokenizer.pad_id().value_or(tokenizer.eos_id().value_or(0));
  const models::TokenRows rows = models::OneExamplePerSequence(encoded, seq_len, pad_id);

  std::vector<float> logits(size_t(seq_len) * config.vocab_size);
  nlohmann::json sequences = nlohmann::json::array();
  double total_loss = 0;
  int64_t total_scored = 0;
  for (int64_t r = 0; r < rows.rows(); ++r) {
    const int32_t* tokens = rows.tokens.data() + r * seq_len;
    const int32_t* targets = rows.targets.data() + r * seq_len;
    const int length = rows.lengths[r];
    const int64_t scored =
        std::count_if(targets, targets + length, [](int32_t t) { return t != models::kIgnoredTarget; });
    nlohmann::json sequence = {{"line", rows.lines[r]}, {"tokens", length + 1}, {"scored", scored}};
    if (scored == 0) {
      sequence["loss"] = nullptr;  // its response was cut off
      sequence["perplexity"] = nullptr;
    } else {
      ESTUARY_RETURN_IF_ERROR(model.Forward(tokens, 1, length, logits.data()));
      const float loss =
          models::CrossEntropyForwardBackward(logits.data(), targets, length, config.vocab_size, logits.data());
      sequence["loss"] = loss;
      sequence["perplexity"] = std::exp(double(loss));
      total_loss += double(loss) * double(scored);
      total_scored += scored;
    }
    sequences.push_back(std::move(sequence));
  }
  nlohmann::json total = {{"sequences", rows.rows()},
                          {"scored", total_scored},
                          {"truncated", rows.truncated_examples},
                          {"seq_len", seq_len},
                          {"template", models::PromptTemplateName(prompt_template)}};
  total["loss"] = total_scored > 0 ? nlohmann::json(total_loss / double(total_scored)) : nlohmann::json(nullptr);
  total["perplexity"] =
      total_scored > 0 ? nlohmann::json(std::exp(total_loss / double(total_scored))) : nlohmann::json(nullptr);
  const std::string out = nlohmann::json{{"sequences", sequences}, {"total", total}}.dump() + "\n";
  std::fwrite(out.data(), 1, out.size(), stdout);
  if (std::fflush(stdout) != 0) return IoError("standard output: cannot write");
  return Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"estuary-lm: language-model utilities"};
  ShowDefaultsInHelp(app);
  app.require_subcommand(1);

  TokenizeFlags tokenize;
  auto* tok = app.add_subcommand("tokenize", "text lines to JSON arrays of token ids (or back, with --decode)");
  tok->add_option("--tokenizer", tokenize.tokenizer, "a Hugging Face tokenizer.json")->required();
  tok->add_flag("--add-special-tokens", tokenize.add_special_tokens,
                "add what the post-processor adds (e.g. BOS) to each line");
  tok->add_flag("--decode", tokenize.decode, "read JSON arrays of ids, write their text");
  tok->add_flag("--skip-special-tokens", tokenize.skip_special_tokens, "with --decode: leave special tokens out");

  ScoreFlags score;
  CLI::App* score_command = AddScoreSubcommand(app, score);

  if (auto exit = ParseCommandLine(app, argc, argv, kProgram)) return *exit;
  if (score_command->parsed()) {
    Status s = Score(score);
    if (!s.ok()) return Fail(kProgram, s);
  }
  if (tok->parsed()) {
    Status s = Tokenize(tokenize);
    if (!s.ok()) return Fail(kProgram, s);
  }
  return 0;
}
