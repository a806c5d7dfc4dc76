// The federated instruction-tuning scenario (`estuary-sim --scenario
// instruct-fortunes`): does a LoRA federation teach a pretrained base to
// follow an instruction on the sites' own topics?
//
//  1. The base: a byte-level decoder pretrained centrally on the fortunes
//     topics no site holds (simulations/fortunes_base.h).
//  2. A character tokenizer whose id for every ASCII character is its byte,
//     so the base's pretraining and the sites' prompts share one vocabulary,
//     plus ChatML's special tokens on unused control-byte ids (written to
//     the workdir as tokenizer.json + tokenizer_config.json).
//  3. Instruction data built from the other topics: one site per topic,
//     each fortune an Alpaca example "Finish this fortune." with its first
//     third as input and the rest as the response. The site trains on its
//     topic's train split, and its test split is held out.
//  4. A LoRA federation (RunInproc: the real instruction trainers, response-
//     only loss, the exact merge by default) from the base; and, for each
//     site, the same adapter trained on its data alone for the same steps.
//  5. Per site: the mean response loss of its held-out examples under the
//     base, the federation's model and its local-only model.
// Everything derives from the seed; a rerun gives the same figures.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace estuary::simulations {

struct InstructFortunesOptions {
  std::filesystem::path data_dir = "/usr/share/games/fortunes";
  std::string topics = "art,food,law,medicine,science,sports";  // the sites'; the rest pretrains the base
  std::string model = "llama-tiny";
  uint32_t seq_len = 128;
  uint32_t batch = 8;
  uint32_t pretrain_steps = 1500;
  float pretrain_lr = 3e-3f;
  uint32_t rounds = 8;
  uint32_t local_steps = 10;  // per site per round
  float lr = 5e-3f;
  uint32_t rank = 8;
  float alpha = 16;
  std::string targets = "q_proj,k_proj,v_proj,o_proj";
  std::string merge = "exact";
  std::string prompt_template = "chatml";
  uint64_t eval_windows = 64;
  uint64_t seed = 2017;
  uint32_t threads = 2;
  bool recompute = false;  // the sites recompute activations (Scenario::recompute)
  std::filesystem::path workdir = "run/instruct-fortunes";
  std::filesystem::path base_model;  // a base.safetensors an earlier run saved: no pretraining
};

struct InstructFortunesSite {
  std::string topic;
  uint64_t train_examples = 0, held_out_examples = 0, held_out_targets = 0;
  double base_loss = 0, federated_loss = 0, local_loss = 0;  // held-out response loss, nats per token
};

struct InstructFortunesReport {
  nlohmann::json options;
  uint64_t pretrain_tokens = 0;  // 0 when the base was given
  double pretrain_loss = 0;
  std::vector<double> round_loss;  // the federation's held-out loss (a tenth of the pooled train file) per round
  uint64_t bytes_per_update = 0;
  std::vector<InstructFortunesSite> sites;
  double total_seconds = 0;
};

Result<InstructFortunesReport> RunInstructFortunes(const InstructFortunesOptions& options,
                                                   const std::function<void(const std::string&)>& progress);

nlohmann::json ToJson(const InstructFortunesReport& report);
// A Markdown table: per site, held-out response loss under the base, the
// federation and local-only training.
std::string RenderInstructFortunes(const InstructFortunesReport& report);

// Writes tokenizer.json and tokenizer_config.json into `dir`: ASCII
// characters on their byte values, <unk> 0, <s> 1, </s> 2, <|im_start|> 3,
// <|im_end|> 4, <pad> 5; any other character encodes as <unk>.
Status WriteAsciiTokenizer(const std::filesystem::path& dir);

}  // namespace estuary::simulations
