// The federated LoRA fine-tuning scenario (`estuary-sim --scenario
// lora-fortunes`): does merging the sites' adapters exactly matter?
//
//  1. Pretrain a small byte-level decoder centrally on the fortunes topics no
//     site holds (their train split), with the same TextTrainer a site runs,
//     and save it as the base (safetensors, Hugging Face names).
//  2. For each merge rule (naive, exact, frozen-a) run a LoRA federation from
//     that base in process (RunInproc: the real trainers and LoraStrategy),
//     one site per held topic, every site every round.
//  3. Train one LoRA centrally on the sites' pooled train text with the same
//     total step budget (rounds × sites × local steps, same batch and lr).
//  4. Score every site's held-out text (its topic's test split) under the
//     base, each federation's final model and the centralised LoRA:
//     perplexity per byte, exp(mean cross-entropy).
// Everything derives from the seed; a rerun gives the same figures.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace estuary::simulations {

struct LoraFortunesOptions {
  std::filesystem::path data_dir = "/usr/share/games/fortunes";
  // The sites' topics; every other topic of data_dir pretrains the base.
  std::string topics = "art,food,law,medicine,science,sports";
  std::string model = "llama-tiny";
  uint32_t seq_len = 64;
  uint32_t batch = 16;
  uint32_t pretrain_steps = 1500;
  float pretrain_lr = 3e-3f;
  uint32_t rounds = 8;
  uint32_t local_steps = 10;  // per site per round
  float lr = 5e-3f;           // AdamW, for the adapters (fresh each round)
  uint32_t rank = 8;
  float alpha = 16;
  std::string targets = "q_proj,k_proj,v_proj,o_proj";
  std::vector<std::string> merges = {"naive", "exact", "frozen-a"};
  std::string lora_base_dtype = "f32";  // how the federations' sites keep the base (centralised LoRA: f32)
  bool recompute = false;               // the federations' sites recompute activations (Scenario::recompute)
  uint64_t eval_windows = 64;  // per-round global evaluation in each federation (all topics)
  uint64_t seed = 2017;
  uint32_t threads = 2;
  std::filesystem::path workdir = "run/lora-fortunes";  // base.safetensors and the PEFT adapters land here
  // A base saved by an earlier run (its base.safetensors): step 1 is skipped.
  std::filesystem::path base_model;
};

struct LoraFortunesSite {
  std::string topic;
  uint64_t train_tokens = 0, test_tokens = 0;
  double base_ppl = 0;
  std::map<std::string, double> ppl;  // "naive", "exact", "frozen-a", "central" -> held-out perplexity
};

struct LoraFortunesRun {
  std::string merge;
  uint64_t bytes_per_update = 0;   // one site's upload
  uint64_t merge_bytes_down = 0;   // per site per round, the last round's
  double seconds = 0;
};

struct LoraFortunesReport {
  nlohmann::json options;
  uint64_t pretrain_tokens = 0;  // 0 when the base was given
  double pretrain_loss = 0;      // mean over the pretraining's last epoch (a single partial one here)
  uint64_t full_bytes_per_update = 0;  // what a full delta of the same decoder would be
  std::vector<LoraFortunesRun> runs;
  uint64_t central_steps = 0;
  std::vector<LoraFortunesSite> sites;
  double total_seconds = 0;
};

using LoraFortunesProgress = std::function<void(const std::string& what)>;

Result<LoraFortunesReport> RunLoraFortunes(const LoraFortunesOptions& options, const LoraFortunesProgress& progress);

nlohmann::json ToJson(const LoraFortunesReport& report);
// A Markdown table: one row per site, perplexity under the base, each merge
// rule and the centralised LoRA; then the bytes per update of each.
std::string RenderLoraFortunes(const LoraFortunesReport& report);

}  // namespace estuary::simulations
