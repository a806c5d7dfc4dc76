// estuary-lm: language-model utilities on the command line.
//
//   estuary-lm tokenize --tokenizer DIR/tokenizer.json [--add-special-tokens] < text
//       each line of standard input (without its newline) -> a JSON array of ids
//   estuary-lm tokenize --tokenizer DIR/tokenizer.json --decode [--skip-special-tokens] < ids
//       each line a JSON array of ids -> its text
//   estuary-lm generate --model DIR --tokenizer FILE --prompt TEXT [--adapter DIR] [--max-new-tokens N]
//                       [--temperature T] [--top-k K] [--top-p P] [--seed S] [--stop-id ID]... [--json]
//                       [--device cpu|cuda|cuda:N] [--precision fp32|bf16|fp16]
//       the prompt (with the tokenizer's special tokens, e.g. BOS) continued by a Hugging Face model
//       directory (with a PEFT LoRA adapter merged in), on the CPU (models/generate.h) or, in a build
//       with CUDA, on a GPU (models/cuda/llama_decoder.h) in the given precision; prints the new
//       text, or with --json the prompt's and the new ids, each new token's log-probability, the text
//       and the device it ran on ("cpu f32", "cuda:0 (NVIDIA H100 ...) bf16")
//
//   estuary-lm inspect --model DIR
//       a Hugging Face model directory's config.json -> JSON on stdout: the
//       architecture, the shapes, the parameter count and the memory its
//       weights take in f32 and bf16, and fp32 training with AdamW
//       (weights, gradients and two moments: 16 bytes a parameter)
//
//   estuary-lm score --model DIR --tokenizer FILE --data FILE.jsonl [--template NAME] [--seq-len N]
//       each example of the JSONL file (models/instruction_data.h) one
//       sequence under the template (models/prompt_template.h), cut to N + 1
//       tokens (by default the longest example's, within the model's context); its loss over the scored
//       tokens and perplexity, and the total, as JSON on standard output
//
// The tokenizer is Hugging Face's tokenizer.json (models/tokenizer.h), with
// tokenizer_config.json read from beside it when there; the model directory is
// what models::LoadHfCheckpoint reads (models/llama.h). Errors are one line
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
#include "models/generate.h"
#include "models/hf_common.h"
#include "models/instruction_data.h"
#include "models/llama.h"
#include "models/lm_sequences.h"
#include "models/lora.h"
#include "models/prompt_template.h"
#include "models/tokenizer.h"
#include "models/transformer_ops.h"

#ifdef ESTUARY_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <charconv>

#include "models/cuda/device.h"
#include "models/cuda/llama_decoder.h"
#include "models/cuda/llama_engine.h"
#endif

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

struct GenerateFlags {
  std::string model, tokenizer, prompt, adapter;
  int max_new_tokens = 64;
  models::SamplingOptions sampling;
  std::vector<int32_t> stop_ids;
  bool json = false;
  std::string device = "cpu", precision = "fp32";
};

CLI::App* AddGenerateCommand(CLI::App& app, GenerateFlags& flags) {
  auto* command =
      app.add_subcommand("generate", "continue a prompt with a language model (KV cache, on the CPU or a GPU)");
  command->add_option("--model", flags.model, "a Hugging Face model directory (config.json, model.safetensors)")
      ->required();
  command->add_option("--tokenizer", flags.tokenizer, "a Hugging Face tokenizer.json")->required();
  command->add_option("--prompt", flags.prompt, "the text to continue")->required();
  command->add_option("--adapter", flags.adapter, "a PEFT LoRA adapter directory, merged into the model");
  command->add_option("--max-new-tokens", flags.max_new_tokens, "at most this many new tokens");
  command->add_option("--temperature", flags.sampling.temperature, "0: greedy (argmax)");
  command->add_option("--top-k", flags.sampling.top_k, "sample among the k most likely tokens (0: all)");
  command->add_option("--top-p", flags.sampling.top_p, "sample within the smallest set of this probability");
  command->add_option("--seed", flags.sampling.seed, "the same seed gives the same tokens");
  command->add_option("--stop-id", flags.stop_ids, "stop after this token id too (the tokenizer's EOS always stops)");
  command->add_flag("--json", flags.json, "print ids, per-token log-probabilities and text as JSON");
  command->add_option("--device", flags.device, "where to run: cpu | cuda | cuda:N (a build with CUDA)");
  command->add_option("--precision", flags.precision, "fp32 | bf16 | fp16 (bf16 and fp16 on cuda only)");
  return command;
}

// The model to generate with: the checkpoint, with the adapter merged in when
// one is given, at a context of `positions` or the model's own if shorter (a
// published config's 128k positions would map an attention arena that
// generation never touches).
Result<models::Llama> LoadGenerationModel(const GenerateFlags& flags, int64_t positions) {
  ESTUARY_ASSIGN_OR_RETURN(const models::LlamaConfig config, models::ReadHfConfig(flags.model, /*max_seq_len=*/1));
  const int context = int(std::clamp<int64_t>(positions, 1, config.max_position_embeddings));
  ESTUARY_ASSIGN_OR_RETURN(models::Llama base, models::LoadHfCheckpoint(flags.model, {.max_seq_len = context}));
  if (flags.adapter.empty()) return base;
  ESTUARY_ASSIGN_OR_RETURN(models::LoraConfig lora_config, models::ReadLoraConfig(flags.adapter));
  ESTUARY_ASSIGN_OR_RETURN(models::LoraLlama adapted, models::LoraLlama::Create(std::move(base), lora_config));
  ESTUARY_RETURN_IF_ERROR(models::LoadLoraAdapter(flags.adapter, adapted));
  return adapted.Merged();
}

// --device and --precision: cpu runs fp32; cuda[:N] any of the three, in a
// build with CUDA and where a device can run its kernels.
Status CheckGenerateDevice(const GenerateFlags& flags) {
  if (flags.precision != "fp32" && flags.precision != "bf16" && flags.precision != "fp16") {
    return InvalidArgument("--precision '{}': expected fp32, bf16 or fp16", flags.precision);
  }
  if (flags.device == "cpu") {
    if (flags.precision != "fp32") {
      return InvalidArgument("--precision {} needs --device cuda: the CPU decoder runs in fp32", flags.precision);
    }
    return Status::Ok();
  }
  if (flags.device != "cuda" && !flags.device.starts_with("cuda:")) {
    return InvalidArgument("--device '{}': expected cpu, cuda or cuda:N", flags.device);
  }
#ifdef ESTUARY_HAVE_CUDA
  int index = 0;
  if (flags.device.size() > 5) {
    const std::string_view digits = std::string_view(flags.device).substr(5);
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    if (ec != std::errc() || end != digits.data() + digits.size() || index < 0) {
      return InvalidArgument("--device '{}': the device index must be a number", flags.device);
    }
  }
  // Every failure to reach a device names the flag, as the tests that skip without one expect.
  if (Status usable = models::cuda::CudaUsable(); !usable.ok()) {
    return FailedPrecondition("--device {}: {}", flags.device, usable.message());
  }
  Result<int> count = models::cuda::CudaDeviceCount();
  if (!count.ok()) return FailedPrecondition("--device {}: {}", flags.device, count.status().message());
  if (index >= *count) return InvalidArgument("--device {}: {} CUDA device(s) visible", flags.device, *count);
  if (const cudaError_t e = cudaSetDevice(index); e != cudaSuccess) {
    return FailedPrecondition("--device {}: cudaSetDevice: {}", flags.device, cudaGetErrorString(e));
  }
  if (Status usable = models::cuda::CudaUsable(); !usable.ok()) {
    return FailedPrecondition("--device {}: {}", flags.device, usable.message());
  }
  return Status::Ok();
#else
  return FailedPrecondition("--device {}: this build has no CUDA backend (nvcc was not found when it was configured)",
                            flags.device);
#endif
}

// Generate on the GPU: the (merged) model's weights into a frozen engine, and
// its cached decoder. `device` gets what the decoder reports.
Result<models::Generation> GenerateOnGpu(const GenerateFlags& flags, const models::Llama& model,
                                         std::span<const int32_t> prompt, const models::GenerateOptions& options,
                                         std::string* device) {
#ifdef ESTUARY_HAVE_CUDA
  namespace cuda = models::cuda;
  const DType precision = flags.precision == "bf16"   ? DType::kBF16
                          : flags.precision == "fp16" ? DType::kF16
                                                      : DType::kF32;
  ESTUARY_ASSIGN_OR_RETURN(cuda::LlamaEngine engine,
                           cuda::LlamaEngine::Create(model.config(), 1, {.precision = precision, .train_base = false}));
  ESTUARY_RETURN_IF_ERROR(engine.CopyParametersFrom(model.parameters()));
  // The positions Generate needs, within the model's context (Generate refuses more, naming it).
  const int64_t positions = int64_t(prompt.size()) + std::max(options.max_new_tokens - 1, 0);
  const int capacity = int(std::clamp<int64_t>(positions, 1, model.config().max_seq_len));
  ESTUARY_ASSIGN_OR_RETURN(cuda::LlamaDecoder decoder, cuda::LlamaDecoder::Create(engine, capacity));
  *device = decoder.device();
  return models::Generate(decoder, prompt, options);
#else
  (void)model, (void)prompt, (void)options, (void)device;
  return FailedPrecondition("--device {}: this build has no CUDA backend", flags.device);
#endif
}

Status RunGenerate(const GenerateFlags& flags) {
  ESTUARY_RETURN_IF_ERROR(flags.sampling.Validate());
  ESTUARY_RETURN_IF_ERROR(CheckGenerateDevice(flags));
  ESTUARY_ASSIGN_OR_RETURN(models::Tokenizer tokenizer, models::Tokenizer::Load(flags.tokenizer));
  const std::vector<int32_t> prompt = tokenizer.Encode(flags.prompt, /*add_special_tokens=*/true);
  // The positions Generate needs (the last new token is never fed back).
  const int64_t positions = int64_t(prompt.size()) + std::max(flags.max_new_tokens - 1, 0);
  ESTUARY_ASSIGN_OR_RETURN(models::Llama model, LoadGenerationModel(flags, positions));
  if (tokenizer.vocab_size() > model.config().vocab_size) {
    return InvalidArgument("{}: {} tokens, more than the vocab_size {} of the model in {}", flags.tokenizer,
                           tokenizer.vocab_size(), model.config().vocab_size, flags.model);
  }
  models::GenerateOptions options{.max_new_tokens = flags.max_new_tokens, .sampling = flags.sampling,
                                  .stop_tokens = flags.stop_ids};
  if (tokenizer.eos_id()) options.stop_tokens.push_back(*tokenizer.eos_id());
  models::Generation out;
  std::string device;
  if (flags.device == "cpu") {
    ESTUARY_ASSIGN_OR_RETURN(out, models::Generate(model, prompt, options));
    device = "cpu f32";
  } else {
    ESTUARY_ASSIGN_OR_RETURN(out, GenerateOnGpu(flags, model, prompt, options, &device));
  }
  const std::string text = tokenizer.Decode(out.tokens, /*skip_special_tokens=*/true);
  if (flags.json) {
    const nlohmann::json report = {{"prompt_ids", prompt}, {"ids", out.tokens}, {"log_probs", out.log_probs},
                                   {"stopped", out.stopped}, {"text", text}, {"device", device}};
    fmt::print("{}\n", report.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  } else {
    fmt::print("{}\n", text);
  }
  if (std::fflush(stdout) != 0) return IoError("standard output: cannot write");
  return Status::Ok();
}

Status Inspect(const std::string& dir) {
  // At a context of one token: inspect describes the weights, and no 128k-token
  // attention arena (nor a sliding window shorter than it) is in question.
  ESTUARY_ASSIGN_OR_RETURN(const models::LlamaConfig c, models::ReadHfConfig(dir, /*max_seq_len=*/1));
  const double parameters = c.ParameterCount();
  const std::string gpu_lacks = models::GpuEngineLacks(c);
  const nlohmann::ordered_json out = {
      {"model", dir},
      {"architecture", c.architecture},
      {"config",
       {{"vocab_size", c.vocab_size},
        {"hidden_size", c.hidden_size},
        {"intermediate_size", c.intermediate_size},
        {"num_hidden_layers", c.num_layers},
        {"num_attention_heads", c.num_heads},
        {"num_key_value_heads", c.num_kv_heads},
        {"head_dim", c.head_dim()},
        {"max_position_embeddings", c.max_position_embeddings},
        {"tie_word_embeddings", c.tie_embeddings},
        {"qkv_bias", c.qkv_bias},
        {"o_bias", c.o_bias},
        {"mlp_bias", c.mlp_bias},
        {"rms_norm_eps", c.rms_norm_eps},
        {"rope_theta", c.rope_theta},
        {"rope_scaling", models::hf::RopeScalingJson(c.rope_scaling)}}},
      {"parameters", int64_t(parameters)},
      {"bytes",
       {{"weights_f32", int64_t(4 * parameters)},
        {"weights_bf16", int64_t(2 * parameters)},
        {"training_f32_adamw", int64_t(16 * parameters)}}},
      {"gpu_engine", gpu_lacks.empty() ? nlohmann::ordered_json("supported") : nlohmann::ordered_json(gpu_lacks)},
  };
  std::fputs((out.dump(2) + "\n").c_str(), stdout);
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
  command->add_option("--seq-len", flags.seq_len, "tokens per sequence (0: the longest example's, within the model's context)")
      ->check(CLI::NonNegativeNumber);
  return command;
}

// One example per sequence, each scored by Forward and the loss of
// Llama::ForwardBackward (the same function on the same logits), so a
// sequence's loss is the number training reports for it.
Status Score(const ScoreFlags& flags) {
  ESTUARY_ASSIGN_OR_RETURN(models::PromptTemplate prompt_template, models::PromptTemplateNamed(flags.template_name));
  ESTUARY_ASSIGN_OR_RETURN(models::Tokenizer tokenizer, models::Tokenizer::Load(flags.tokenizer));
  ESTUARY_ASSIGN_OR_RETURN(const models::LlamaConfig file_config, models::ReadHfConfig(flags.model, 1));
  const int context = file_config.max_position_embeddings;
  if (flags.seq_len > context) {
    return InvalidArgument("--seq-len {} is longer than the model's context ({}, max_position_embeddings)",
                           flags.seq_len, context);
  }
  ESTUARY_ASSIGN_OR_RETURN(std::vector<models::InstructionExample> examples, models::LoadInstructionJsonl(flags.data));
  ESTUARY_ASSIGN_OR_RETURN(models::ExampleEncoder encoder,
                           models::ExampleEncoder::Create(tokenizer, prompt_template, flags.tokenizer));
  ESTUARY_ASSIGN_OR_RETURN(std::vector<models::EncodedExample> encoded, encoder.EncodeAll(examples, flags.data));
  // By default the model runs at the longest example's length, within its
  // context: a published config's 128k positions would map an attention arena
  // that no example here needs.
  size_t longest = 2;
  for (const models::EncodedExample& e : encoded) longest = std::max(longest, e.ids.size());
  const int seq_len = flags.seq_len > 0 ? flags.seq_len : int(std::min<size_t>(longest - 1, size_t(context)));
  ESTUARY_ASSIGN_OR_RETURN(models::Llama model, models::LoadHfCheckpoint(flags.model, {.max_seq_len = seq_len}));
  const models::LlamaConfig& config = model.config();
  if (tokenizer.vocab_size() > config.vocab_size) {
    return InvalidArgument("{}: {} tokens, more than the vocabulary of the model in {} ({})", flags.tokenizer,
                           tokenizer.vocab_size(), flags.model, config.vocab_size);
  }
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

  GenerateFlags generate;
  CLI::App* generate_command = AddGenerateCommand(app, generate);

  std::string model_dir;
  auto* inspect =
      app.add_subcommand("inspect", "a Hugging Face model directory's shapes, parameters and memory, as JSON");
  inspect->add_option("--model", model_dir, "a directory with config.json (Llama, Mistral or Qwen2)")->required();
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
  if (generate_command->parsed()) {
    Status s = RunGenerate(generate);
    if (!s.ok()) return Fail(kProgram, s);
  }
  if (inspect->parsed()) {
    Status s = Inspect(model_dir);
    if (!s.ok()) return Fail(kProgram, s);
  }
  return 0;
}
