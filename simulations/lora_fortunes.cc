#include "simulations/lora_fortunes.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "base/split.h"
#include "client/site.h"
#include "models/language_model.h"
#include "models/lora_federation.h"
#include "models/text_corpus.h"
#include "simulations/fortunes_base.h"
#include "simulations/runner.h"

namespace estuary::simulations {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Held-out perplexity per byte of `params` (a base decoder's weights) on a
// site's test tokens: every window of seq_len, up to 4096 of them.
Result<double> Perplexity(models::Llama& model, std::span<const float> params, std::span<const int32_t> tokens,
                          int seq) {
  ESTUARY_ASSIGN_OR_RETURN(const models::EvalResult eval, models::EvaluateLanguageModel(model, params, tokens, seq, 4096));
  return std::exp(eval.loss);
}

// base + (alpha/r)·B·A of a LoRA global buffer.
Result<std::vector<float>> Adapted(const models::LoraGlobalLayout& layout, std::span<const float> global, float alpha) {
  std::vector<float> merged(global.begin(), global.begin() + layout.base.total_elements);
  ESTUARY_RETURN_IF_ERROR(
      models::AddLoraToBase(layout.base, merged, layout.adapter, global.subspan(layout.adapter_offset()), alpha));
  return merged;
}

}  // namespace

Result<LoraFortunesReport> RunLoraFortunes(const LoraFortunesOptions& o, const LoraFortunesProgress& progress) {
  const auto start = Clock::now();
  auto say = [&](const std::string& what) {
    if (progress) progress(what);
  };
  LoraFortunesReport report;
  report.options = {{"data", o.data_dir.string()}, {"topics", o.topics},         {"model", o.model},
                    {"seq_len", o.seq_len},        {"batch", o.batch},           {"pretrain_steps", o.pretrain_steps},
                    {"pretrain_lr", o.pretrain_lr}, {"rounds", o.rounds},        {"local_steps", o.local_steps},
                    {"lr", o.lr},                  {"rank", o.rank},             {"alpha", o.alpha},
                    {"targets", o.targets},        {"merges", o.merges},         {"seed", o.seed},
                    {"base_model", o.base_model.string()}, {"lora_base_dtype", o.lora_base_dtype},
                    {"recompute", o.recompute}};
  const std::vector<std::string> topics = SplitCommas(o.topics);
  // 1. The base.
  ESTUARY_ASSIGN_OR_RETURN(const FortunesBase made, MakeFortunesBase(BaseOptionsOf(o, topics, "lora-fortunes"), say));
  const models::LlamaConfig& config = made.config;
  const std::vector<float>& base = made.weights;
  const fs::path& base_path = made.path;
  report.pretrain_tokens = made.pretrain_tokens;
  report.pretrain_loss = made.pretrain_loss;
  report.full_bytes_per_update = made.initial.values.size() * sizeof(float);
  auto by_name = [&](const std::string& topic) { return &made.Topic(topic); };

  ESTUARY_ASSIGN_OR_RETURN(models::Llama scorer, models::Llama::Create(config, 8));
  for (const auto& topic : topics) {
    const models::TextSource& source = *by_name(topic);
    LoraFortunesSite site;
    site.topic = topic;
    site.train_tokens = source.train.size();
    site.test_tokens = source.test.size();
    ESTUARY_ASSIGN_OR_RETURN(site.base_ppl, Perplexity(scorer, base, source.test, int(o.seq_len)));
    report.sites.push_back(std::move(site));
  }

  // 2. One LoRA federation per merge rule, from the saved base.
  Scenario s;
  v1::TaskConfig& task = s.task();
  task.set_model(o.model);
  s.partition = "topic";
  s.topics = o.topics;
  s.clients = uint32_t(topics.size());
  s.per_round = double(topics.size());
  s.rounds = o.rounds;
  task.set_batch_size(o.batch);
  task.set_seq_len(o.seq_len);
  task.set_max_local_steps(o.local_steps);
  task.set_learning_rate(o.lr);
  task.set_optimizer("adamw");
  task.set_update_kind(v1::UPDATE_LORA);
  task.mutable_lora()->set_rank(o.rank);
  task.mutable_lora()->set_alpha(o.alpha);
  task.mutable_lora()->clear_target_modules();
  for (const std::string& module : SplitCommas(o.targets)) task.mutable_lora()->add_target_modules(module);
  s.lora_base_dtype = o.lora_base_dtype;
  s.recompute = o.recompute;
  s.federation.set_base_model(base_path.string());
  s.data_dir = o.data_dir;
  s.federation.set_eval_windows(o.eval_windows);
  task.set_seed(o.seed);
  s.threads = o.threads;
  uint64_t fewest_windows = UINT64_MAX;
  for (const auto& topic : topics) fewest_windows = std::min<uint64_t>(fewest_windows, (by_name(topic)->train.size() - 1) / o.seq_len);
  task.set_epochs(EpochsFor(o.local_steps, fewest_windows, o.batch));
  ESTUARY_ASSIGN_OR_RETURN(const aggregation::LoraStrategyOptions lora_options, aggregation::LoraOptionsOf(task));
  const models::LoraGlobalLayout& layout = lora_options.layout;
  models::LoraConfig lora = aggregation::LoraConfigOf(task);
  lora.base_model_name_or_path = base_path.string();  // what the exported adapter applies to
  for (const std::string& merge : o.merges) {
    task.mutable_lora()->set_merge(merge);
    say(fmt::format("federation: {} sites, {} rounds of {} local steps, rank {}, merge {}", topics.size(), o.rounds,
                    o.local_steps, o.rank, merge));
    std::vector<float> global;
    ESTUARY_ASSIGN_OR_RETURN(Report run, RunInproc(s, nullptr, &global));
    report.runs.push_back({.merge = merge,
                           .bytes_per_update = run.rounds.back().bytes_per_update,
                           .merge_bytes_down = run.rounds.back().merge_bytes_down,
                           .seconds = run.total_seconds});
    ESTUARY_ASSIGN_OR_RETURN(const std::vector<float> adapted, Adapted(layout, global, o.alpha));
    for (auto& site : report.sites) {
      ESTUARY_ASSIGN_OR_RETURN(site.ppl[merge], Perplexity(scorer, adapted, by_name(site.topic)->test, int(o.seq_len)));
    }
    if (merge == "exact") {
      // The federation's adapter as PEFT saves it, beside the base it adapts.
      ESTUARY_ASSIGN_OR_RETURN(models::Llama b, models::Llama::Create(config, 1));
      std::copy(global.begin(), global.begin() + layout.base.total_elements, b.parameters().begin());
      ESTUARY_ASSIGN_OR_RETURN(models::LoraLlama adapter, models::LoraLlama::Create(std::move(b), lora));
      std::copy(global.begin() + layout.adapter_offset(), global.end(), adapter.parameters().begin());
      ESTUARY_RETURN_IF_ERROR(models::SaveLoraAdapter(o.workdir / "exact-adapter", adapter));
    }
  }

  // 3. Centralised LoRA on the pooled train text, the same number of steps.
  std::vector<int32_t> pooled;
  for (const auto& topic : topics) {
    const auto& train = by_name(topic)->train;
    pooled.insert(pooled.end(), train.begin(), train.end());
  }
  report.central_steps = uint64_t(o.rounds) * topics.size() * o.local_steps;
  say(fmt::format("centralised LoRA: {} steps on the {} pooled bytes", report.central_steps, pooled.size()));
  ESTUARY_ASSIGN_OR_RETURN(models::InitialWeights start_model, models::LoraInitialModel(o.model, lora, o.seed, base_path));
  v1::TaskConfig central = task;  // the federation's adapters, trained on the pooled text
  central.mutable_lora()->set_merge("exact");
  central.set_max_local_steps(uint32_t(report.central_steps));
  central.set_epochs(EpochsFor(report.central_steps, (pooled.size() - 1) / o.seq_len, o.batch));
  ESTUARY_ASSIGN_OR_RETURN(
      auto pooled_trainer, client::MakeLocalSite({.text = std::make_shared<const std::vector<int32_t>>(std::move(pooled))}, {}));
  ESTUARY_ASSIGN_OR_RETURN(client::Update adapter,
                           pooled_trainer->Train(start_model.values, start_model.manifest, central, 1, "central"));
  std::vector<float> central_model = base;
  ESTUARY_RETURN_IF_ERROR(models::AddLoraToBase(layout.base, central_model, adapter.manifest, adapter.payload, o.alpha));
  for (auto& site : report.sites) {
    ESTUARY_ASSIGN_OR_RETURN(site.ppl["central"],
                             Perplexity(scorer, central_model, by_name(site.topic)->test, int(o.seq_len)));
  }
  report.total_seconds = Since(start);
  return report;
}

nlohmann::json ToJson(const LoraFortunesReport& r) {
  nlohmann::json sites = nlohmann::json::array(), runs = nlohmann::json::array();
  for (const auto& site : r.sites) {
    sites.push_back({{"topic", site.topic}, {"train_tokens", site.train_tokens}, {"test_tokens", site.test_tokens},
                     {"base_ppl", site.base_ppl}, {"ppl", site.ppl}});
  }
  for (const auto& run : r.runs) {
    runs.push_back({{"merge", run.merge}, {"bytes_per_update", run.bytes_per_update},
                    {"merge_bytes_down", run.merge_bytes_down}, {"seconds", run.seconds}});
  }
  return {{"scenario", "lora-fortunes"},          {"options", r.options},     {"pretrain_tokens", r.pretrain_tokens},
          {"pretrain_loss", r.pretrain_loss},     {"full_bytes_per_update", r.full_bytes_per_update},
          {"runs", runs},                         {"central_steps", r.central_steps},
          {"sites", sites},                       {"total_seconds", r.total_seconds}};
}

std::string RenderLoraFortunes(const LoraFortunesReport& r) {
  std::vector<std::string> columns;
  for (const auto& run : r.runs) columns.push_back(run.merge);
  columns.push_back("central");
  std::string out = "| site (held-out bytes) | base |";
  for (const auto& c : columns) out += fmt::format(" {} |", c == "central" ? "centralised LoRA" : c);
  out += "\n|---|---:|";
  for (size_t i = 0; i < columns.size(); ++i) out += "---:|";
  out += "\n";
  std::map<std::string, double> log_sum;
  double base_log_sum = 0;
  for (const auto& site : r.sites) {
    out += fmt::format("| {} ({}) | {:.3f} |", site.topic, site.test_tokens, site.base_ppl);
    base_log_sum += std::log(site.base_ppl);
    for (const auto& c : columns) {
      out += fmt::format(" {:.3f} |", site.ppl.at(c));
      log_sum[c] += std::log(site.ppl.at(c));
    }
    out += "\n";
  }
  const double n = double(r.sites.size());
  out += fmt::format("| geometric mean | {:.3f} |", std::exp(base_log_sum / n));
  for (const auto& c : columns) out += fmt::format(" {:.3f} |", std::exp(log_sum[c] / n));
  out += "\n\n| update | bytes per update | merge sends back per site per round |\n|---|---:|---:|\n";
  out += fmt::format("| full delta (for scale) | {} | {} (the model) |\n", r.full_bytes_per_update,
                     r.full_bytes_per_update);
  for (const auto& run : r.runs) {
    out += fmt::format("| lora, {} | {} | {} |\n", run.merge, run.bytes_per_update, run.merge_bytes_down);
  }
  return out;
}

}  // namespace estuary::simulations
