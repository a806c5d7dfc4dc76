#include "simulations/instruct_fortunes.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <map>

#include "base/atomic_file.h"
#include "base/split.h"
#include "models/instruction_set.h"
#include "client/site.h"
#include "models/language_model.h"
#include "models/lora_federation.h"
#include "models/tokenizer.h"
#include "simulations/fortunes_base.h"
#include "simulations/runner.h"

namespace estuary::simulations {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kInstruction = "Finish this fortune.";

// The documents of a stream LoadFortunes joined, each followed by "\n%\n".
Result<std::vector<std::string>> Documents(std::span<const int32_t> stream) {
  ESTUARY_ASSIGN_OR_RETURN(const std::string text, models::ByteTokenizer::Decode(stream));
  std::vector<std::string> out;
  size_t begin = 0;
  for (size_t end; (end = text.find("\n%\n", begin)) != std::string::npos; begin = end + 3) {
    out.push_back(text.substr(begin, end - begin));
  }
  if (begin < text.size()) out.push_back(text.substr(begin));
  return out;
}

// A fortune as an instruction: its first third of words the input, the rest
// the response. Fortunes of fewer than three words make none.
std::optional<models::InstructionExample> AsInstruction(const std::string& fortune) {
  std::vector<size_t> word_starts;
  for (size_t i = 0; i < fortune.size(); ++i) {
    const bool space = std::isspace(static_cast<unsigned char>(fortune[i]));
    if (!space && (i == 0 || std::isspace(static_cast<unsigned char>(fortune[i - 1])))) word_starts.push_back(i);
  }
  if (word_starts.size() < 3) return std::nullopt;
  const size_t split = word_starts[word_starts.size() / 3];
  models::InstructionExample e;
  e.kind = models::InstructionExample::Kind::kAlpaca;
  e.instruction = kInstruction;
  e.input = fortune.substr(0, split);
  while (!e.input.empty() && std::isspace(static_cast<unsigned char>(e.input.back()))) e.input.pop_back();
  e.output = fortune.substr(split);
  return e;
}

Status WriteJsonl(const fs::path& path, const std::vector<nlohmann::json>& lines) {
  std::string text;
  for (const auto& line : lines) text += line.dump() + "\n";
  return WriteFileAtomically(path, text);
}

nlohmann::json AlpacaLine(const std::string& topic, const models::InstructionExample& e) {
  return {{"topic", topic}, {"instruction", e.instruction}, {"input", e.input}, {"output", e.output}};
}

}  // namespace

Status WriteAsciiTokenizer(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return IoError("{}: {}", dir.string(), ec.message());
  const std::vector<std::string> specials = {"<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>"};
  nlohmann::ordered_json vocab, added = nlohmann::json::array();
  for (size_t id = 0; id < specials.size(); ++id) {
    vocab[specials[id]] = id;
    if (id > 0) {
      added.push_back({{"id", id}, {"content", specials[id]}, {"single_word", false}, {"lstrip", false},
                       {"rstrip", false}, {"normalized", false}, {"special", true}});
    }
  }
  vocab["\t"] = int('\t');
  vocab["\n"] = int('\n');
  vocab["\u2581"] = int(' ');  // the Metaspace pre-tokenizer's stand-in for a space
  for (int c = '!'; c <= '~'; ++c) vocab[std::string(1, char(c))] = c;
  const nlohmann::ordered_json metaspace = {
      {"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "never"}, {"split", false}};
  const nlohmann::ordered_json tokenizer = {
      {"version", "1.0"},      {"truncation", nullptr},   {"padding", nullptr},
      {"added_tokens", added}, {"normalizer", nullptr},   {"pre_tokenizer", metaspace},
      {"post_processor", nullptr}, {"decoder", metaspace},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", "<unk>"}, {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr}, {"fuse_unk", true}, {"byte_fallback", false}, {"ignore_merges", false},
        {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
  const nlohmann::ordered_json config = {{"bos_token", "<s>"}, {"eos_token", "</s>"}, {"pad_token", "<pad>"},
                                         {"tokenizer_class", "PreTrainedTokenizerFast"}};
  ESTUARY_RETURN_IF_ERROR(WriteFileAtomically(dir / "tokenizer.json", tokenizer.dump(1) + "\n"));
  return WriteFileAtomically(dir / "tokenizer_config.json", config.dump(2) + "\n");
}

Result<InstructFortunesReport> RunInstructFortunes(const InstructFortunesOptions& o,
                                                   const std::function<void(const std::string&)>& progress) {
  const auto start = Clock::now();
  auto say = [&](const std::string& what) {
    if (progress) progress(what);
  };
  InstructFortunesReport report;
  report.options = {{"data", o.data_dir.string()}, {"topics", o.topics},       {"model", o.model},
                    {"seq_len", o.seq_len},        {"batch", o.batch},         {"pretrain_steps", o.pretrain_steps},
                    {"pretrain_lr", o.pretrain_lr}, {"rounds", o.rounds},      {"local_steps", o.local_steps},
                    {"lr", o.lr},                  {"rank", o.rank},           {"alpha", o.alpha},
                    {"targets", o.targets},        {"merge", o.merge},         {"template", o.prompt_template},
                    {"seed", o.seed},              {"base_model", o.base_model.string()},
                    {"recompute", o.recompute}};
  const std::vector<std::string> topics = SplitCommas(o.topics);
  // 1. The base.
  ESTUARY_ASSIGN_OR_RETURN(const FortunesBase base, MakeFortunesBase(BaseOptionsOf(o, topics, "instruct-fortunes"), say));
  report.pretrain_tokens = base.pretrain_tokens;
  report.pretrain_loss = base.pretrain_loss;

  // 2. The tokenizer, checked to give the base's byte ids for ASCII text.
  const fs::path tokenizer_dir = o.workdir / "tokenizer";
  ESTUARY_RETURN_IF_ERROR(WriteAsciiTokenizer(tokenizer_dir));
  ESTUARY_ASSIGN_OR_RETURN(const models::Tokenizer tokenizer, models::Tokenizer::Load(tokenizer_dir / "tokenizer.json"));
  const std::string probe = "Q: Why?\n\tA: 42 ~ {x}";
  if (tokenizer.Encode(probe, false) != models::ByteTokenizer::Encode(probe)) {
    return Internal("instruct-fortunes: the ASCII tokenizer does not give the bytes of '{}'", probe);
  }

  // 3. The sites' instruction data: the train split in one file, each topic's test split held out.
  // Each site's examples stay in memory for its own training and scoring
  // below; the files are what the federation reads and what a user inspects.
  std::vector<nlohmann::json> train_lines;
  std::map<std::string, std::vector<models::InstructionExample>> train_of, held_of;
  for (const std::string& topic : topics) {
    InstructFortunesSite site;
    site.topic = topic;
    ESTUARY_ASSIGN_OR_RETURN(const auto train, Documents(base.Topic(topic).train));
    ESTUARY_ASSIGN_OR_RETURN(const auto test, Documents(base.Topic(topic).test));
    for (const auto& fortune : train) {
      if (auto e = AsInstruction(fortune)) train_lines.push_back(AlpacaLine(topic, *e)), train_of[topic].push_back(*e);
    }
    std::vector<nlohmann::json> held;
    for (const auto& fortune : test) {
      if (auto e = AsInstruction(fortune)) held.push_back(AlpacaLine(topic, *e)), held_of[topic].push_back(*e);
    }
    site.train_examples = train_of[topic].size();
    site.held_out_examples = held.size();
    ESTUARY_RETURN_IF_ERROR(WriteJsonl(o.workdir / fmt::format("held-out-{}.jsonl", topic), held));
    report.sites.push_back(std::move(site));
  }
  const fs::path train_file = o.workdir / "train.jsonl";
  ESTUARY_RETURN_IF_ERROR(WriteJsonl(train_file, train_lines));
  say(fmt::format("{} instruction examples from {} topics written to {}", train_lines.size(), topics.size(),
                  train_file.string()));

  // 4. The federation, one site per topic, every site every round.
  Scenario s;
  v1::TaskConfig& task = s.task();
  task.set_model(o.model);
  s.data_dir = train_file;
  s.tokenizer = tokenizer_dir / "tokenizer.json";
  s.partition_by = "topic";
  s.clients = 0;
  s.per_round = double(topics.size());
  s.rounds = o.rounds;
  task.set_prompt_template(o.prompt_template);
  task.set_batch_size(o.batch);
  task.set_seq_len(o.seq_len);
  task.set_max_local_steps(o.local_steps);
  task.set_epochs(1000);  // the step cap ends every round
  task.set_learning_rate(o.lr);
  task.set_optimizer("adamw");
  task.set_update_kind(v1::UPDATE_LORA);
  task.mutable_lora()->set_rank(o.rank);
  task.mutable_lora()->set_alpha(o.alpha);
  task.mutable_lora()->set_merge(o.merge);
  task.mutable_lora()->clear_target_modules();
  for (const std::string& module : SplitCommas(o.targets)) task.mutable_lora()->add_target_modules(module);
  task.set_seed(o.seed);
  s.federation.set_base_model(base.path.string());
  s.federation.set_eval_windows(o.eval_windows);
  s.threads = o.threads;
  s.recompute = o.recompute;
  say(fmt::format("federation: {} sites, {} rounds of {} local steps, LoRA rank {} ({} merge), template {}",
                  topics.size(), o.rounds, o.local_steps, o.rank, o.merge, o.prompt_template));
  std::vector<float> global;
  ESTUARY_ASSIGN_OR_RETURN(const Report run, RunInproc(s, nullptr, &global));
  for (const auto& round : run.rounds) report.round_loss.push_back(round.test_loss);
  report.bytes_per_update = run.rounds.back().bytes_per_update;
  ESTUARY_ASSIGN_OR_RETURN(const aggregation::LoraStrategyOptions lora_options, aggregation::LoraOptionsOf(task));
  const models::LoraGlobalLayout& layout = lora_options.layout;
  // The exact merge folds residuals into the base part of the global buffer: take the base from there.
  std::vector<float> federated(global.begin(), global.begin() + layout.base.total_elements);
  ESTUARY_RETURN_IF_ERROR(models::AddLoraToBase(layout.base, federated, layout.adapter,
                                                std::span<const float>(global).subspan(layout.adapter_offset()),
                                                o.alpha));

  // 5. Each site alone, the same adapter for the same steps; then every site's held-out loss.
  ESTUARY_ASSIGN_OR_RETURN(const models::PromptTemplate prompt, models::PromptTemplateNamed(o.prompt_template));
  ESTUARY_ASSIGN_OR_RETURN(models::InitialWeights start_model,
                           models::LoraInitialModel(o.model, aggregation::LoraConfigOf(task), o.seed, base.path));
  ESTUARY_ASSIGN_OR_RETURN(models::Llama scorer, models::Llama::Create(base.config, 8));
  v1::TaskConfig alone = task;
  alone.set_max_local_steps(o.rounds * o.local_steps);
  for (auto& site : report.sites) {
    ESTUARY_ASSIGN_OR_RETURN(const models::InstructionSet held,
                             models::EncodeInstructionSet(held_of[site.topic], tokenizer, prompt,
                                                          fmt::format("held-out-{}.jsonl", site.topic)));
    const models::TokenRows rows = models::PackForTraining(held, int(o.seq_len)).rows;
    ESTUARY_ASSIGN_OR_RETURN(const models::EvalResult before,
                             models::EvaluateLanguageModelRows(scorer, base.weights, rows, 0));
    ESTUARY_ASSIGN_OR_RETURN(const models::EvalResult after,
                             models::EvaluateLanguageModelRows(scorer, federated, rows, 0));
    site.base_loss = before.loss;
    site.federated_loss = after.loss;
    site.held_out_targets = before.examples;

    // Every train example of the topic: the federation's site had the nine
    // tenths of them the simulator did not hold out for its own score.
    ESTUARY_ASSIGN_OR_RETURN(models::InstructionSet own,
                             models::EncodeInstructionSet(train_of[site.topic], tokenizer, prompt,
                                                          fmt::format("train.jsonl ({})", site.topic)));
    say(fmt::format("{}: local-only LoRA, {} steps on {} examples", site.topic, alone.max_local_steps(),
                    own.examples.size()));
    ESTUARY_ASSIGN_OR_RETURN(
        auto trainer, client::MakeLocalSite({.instructions = std::make_shared<const models::InstructionSet>(
                                                 std::move(own))},
                                            {}));
    ESTUARY_ASSIGN_OR_RETURN(client::Update update,
                             trainer->Train(start_model.values, start_model.manifest, alone, 1, site.topic));
    std::vector<float> local(base.weights);
    ESTUARY_RETURN_IF_ERROR(models::AddLoraToBase(layout.base, local, update.manifest, update.payload, o.alpha));
    ESTUARY_ASSIGN_OR_RETURN(const models::EvalResult local_eval,
                             models::EvaluateLanguageModelRows(scorer, local, rows, 0));
    site.local_loss = local_eval.loss;
  }
  report.total_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return report;
}

nlohmann::json ToJson(const InstructFortunesReport& r) {
  nlohmann::json sites = nlohmann::json::array();
  for (const auto& site : r.sites) {
    sites.push_back({{"topic", site.topic},
                     {"train_examples", site.train_examples},
                     {"held_out_examples", site.held_out_examples},
                     {"held_out_targets", site.held_out_targets},
                     {"base_loss", site.base_loss},
                     {"federated_loss", site.federated_loss},
                     {"local_loss", site.local_loss}});
  }
  return {{"scenario", "instruct-fortunes"}, {"options", r.options},       {"pretrain_tokens", r.pretrain_tokens},
          {"pretrain_loss", r.pretrain_loss},  {"round_loss", r.round_loss}, {"bytes_per_update", r.bytes_per_update},
          {"sites", sites},                    {"total_seconds", r.total_seconds}};
}

std::string RenderInstructFortunes(const InstructFortunesReport& r) {
  std::string out =
      "| site | train examples | held-out examples (scored tokens) | base | federated LoRA | local-only LoRA |\n"
      "|---|---:|---:|---:|---:|---:|\n";
  double base = 0, federated = 0, local = 0, targets = 0;
  for (const auto& site : r.sites) {
    out += fmt::format("| {} | {} | {} ({}) | {:.3f} | {:.3f} | {:.3f} |\n", site.topic, site.train_examples,
                       site.held_out_examples, site.held_out_targets, site.base_loss, site.federated_loss,
                       site.local_loss);
    const double n = double(site.held_out_targets);
    base += n * site.base_loss, federated += n * site.federated_loss, local += n * site.local_loss, targets += n;
  }
  if (targets > 0) {
    out += fmt::format("| all (per scored token) | | {} | {:.3f} | {:.3f} | {:.3f} |\n", uint64_t(targets),
                       base / targets, federated / targets, local / targets);
  }
  return out;
}

}  // namespace estuary::simulations
