// The many-client simulation: one scenario, run in process or over loopback.
//
// inproc:   every client trains in this process, `threads` at a time; updates
//           are folded in the sorted order of the clients' names, so a run is
//           bit-for-bit reproducible from its seed.
// loopback: a real estuary-server (a child process, or --server to attach)
//           and one real mutual-TLS connection per client, all in this
//           process; the server folds in arrival order.
// Both modes sample the same clients per round (aggregation::SampleClients)
// and start from the same initial model, so they agree to rounding.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "aggregation/strategy.h"
#include "base/status.h"
#include "client/trainer.h"
#include "models/lora.h"
#include "simulations/report.h"

namespace estuary::simulations {

struct Scenario {
  uint32_t clients = 100;
  double per_round = 10;        // count (>= 1) or fraction (< 1)
  uint64_t rounds = 20;
  uint32_t epochs = 5;
  uint32_t batch = 10;
  float lr = 0.05f;
  float momentum = 0;
  float weight_decay = 0;
  std::string model = "mlp";          // mlp | cnn | llama-tiny | llama-small | llama-124m
  std::string partition = "iid";      // images: iid | shards | dirichlet:ALPHA; text: topic
  std::string topics;                 // text: comma-separated topics the clients hold (empty: the first `clients`)
  std::string optimizer = "sgd";      // local optimizer: sgd | adamw
  uint32_t seq_len = 128;             // language models: tokens per window
  uint32_t max_local_steps = 0;       // 0: every batch of every epoch
  uint64_t eval_windows = 256;        // language models: held-out windows scored per round
  std::string device = "cpu";         // where the clients train: cpu | cuda | cuda:N
  std::string precision = "fp32";     // fp32 | bf16 | fp16 (cuda only)
  aggregation::StrategyOptions strategy;
  // What clients send: "full" (the weight delta) or "lora" (adapter factors
  // on a language model; the strategy is then the LoRA merge, lora_merge).
  std::string update_kind = "full";
  uint32_t lora_rank = 8;
  float lora_alpha = 16;
  float lora_dropout = 0;
  std::string lora_targets = "q_proj,k_proj,v_proj,o_proj";  // comma-separated
  std::string lora_merge = "exact";                          // naive | exact | frozen-a
  // exact only: the sites' own ranks, comma-separated, client i taking entry
  // i mod n (e.g. "4,8,16"); empty: every site trains lora_rank.
  std::string lora_site_ranks;
  std::string lora_base_dtype = "f32";  // how the sites keep the frozen base: f32 | bf16 (the CPU's, half the memory)
  std::filesystem::path base_model;  // lora: the base's safetensors; empty: the preset from the seed
  uint64_t seed = 2017;
  std::string mode = "inproc";
  std::filesystem::path data_dir = "data/mnist";  // text models: a fortunes directory
  uint32_t threads = 2;
  // loopback only
  std::string server;                        // attach to HOST:PORT instead of starting one
  std::filesystem::path round_log;           // with `server`: its SQLite file, for the report
  std::filesystem::path workdir = "run/sim";  // certificates, round log, checkpoints
  std::filesystem::path server_binary;       // default: estuary-server beside this program
};

nlohmann::json ScenarioJson(const Scenario& scenario);

// The scenario's LoRA config (rank, alpha, dropout, targets), validated.
Result<models::LoraConfig> LoraConfigOf(const Scenario& scenario);
// The task every client of the scenario trains (what the server would send).
client::TaskConfig TaskConfigOf(const Scenario& scenario);

// Called after every round, on the thread that runs the simulation.
using RoundCallback = std::function<void(const RoundReport&, uint64_t rounds_total)>;

// With final_global, the global model after the last round is written there
// (for a lora federation: base, then adapter; models/lora_federation.h).
Result<Report> RunInproc(const Scenario& scenario, const RoundCallback& on_round,
                         std::vector<float>* final_global = nullptr);
Result<Report> RunLoopback(const Scenario& scenario, const RoundCallback& on_round);

}  // namespace estuary::simulations
