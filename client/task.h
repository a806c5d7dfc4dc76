// TaskConfig: what a site trains in a round, as the trainers read it. The
// task is defined once, by v1::TaskConfig (proto/estuary.proto), which the
// server sends in every RoundStart and a site's rank 0 broadcasts to its
// other ranks; TaskFromProto is the one mapping from it, on every rank, in
// the agent and in the simulator alike.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"
#include "estuary.pb.h"
#include "models/lora.h"

namespace estuary::client {

enum class UpdateKind { kFull = 0, kLora = 1 };
enum class OptimizerKind { kSgd = 0, kAdamW = 1 };

// A federation of update kind lora (proto LoraTask).
struct LoraTask {
  models::LoraConfig config;    // rank, alpha, dropout, target modules
  std::string merge = "exact";  // naive | exact | frozen-a: under frozen-a A is fixed and only B is uploaded
  bool mixed_ranks = false;     // exact only: a site may train another rank
};

struct TaskConfig {
  std::string model = "mlp";
  uint32_t epochs = 5;
  uint32_t batch_size = 10;
  float learning_rate = 0.05f;
  float momentum = 0.0f;
  float weight_decay = 0.0f;
  UpdateKind update_kind = UpdateKind::kFull;
  uint64_t seed = 0;
  OptimizerKind optimizer = OptimizerKind::kSgd;  // a fresh optimizer every round
  uint32_t seq_len = 128;                          // language models: tokens per window
  uint32_t max_local_steps = 0;                    // 0: every batch of every epoch
  double max_local_seconds = 0;                    // 0: no cap on the round's local training time
  float proximal_mu = 0;                           // FedProx's μ; 0: off
  LoraTask lora;                                   // with update_kind kLora
  // Instruction data: the template every site renders with ("" or "none":
  // no template, text lines only; the proto's empty is "" here).
  std::string prompt_template;
};

Result<OptimizerKind> ParseOptimizer(std::string_view name);  // "sgd" | "adamw"
std::string_view OptimizerName(OptimizerKind kind);

// Checks the task (proto::CheckTask) and maps it. An unset optimizer is sgd.
Result<TaskConfig> TaskFromProto(const v1::TaskConfig& task);

}  // namespace estuary::client
