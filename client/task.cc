#include "client/task.h"

#include <algorithm>

#include "models/hf_base.h"
#include "models/language_model.h"
#include "proto/task.h"

namespace estuary::client {

Result<OptimizerKind> ParseOptimizer(std::string_view name) {
  if (name == "sgd") return OptimizerKind::kSgd;
  if (name == "adamw") return OptimizerKind::kAdamW;
  return InvalidArgument("task: unknown optimizer '{}' (expected sgd or adamw)", name);
}

std::string_view OptimizerName(OptimizerKind kind) { return kind == OptimizerKind::kAdamW ? "adamw" : "sgd"; }

Result<TaskConfig> TaskFromProto(const v1::TaskConfig& t) {
  ESTUARY_RETURN_IF_ERROR(proto::CheckTask(t));
  ESTUARY_ASSIGN_OR_RETURN(const OptimizerKind optimizer,
                           t.optimizer().empty() ? OptimizerKind::kSgd : ParseOptimizer(t.optimizer()));
  TaskConfig task{.model = t.model(), .epochs = t.epochs(), .batch_size = t.batch_size(),
                  .learning_rate = t.learning_rate(), .momentum = t.momentum(), .weight_decay = t.weight_decay(),
                  .update_kind = t.update_kind() == v1::UPDATE_LORA ? UpdateKind::kLora : UpdateKind::kFull,
                  .seed = t.seed(), .optimizer = optimizer, .seq_len = t.seq_len(),
                  .max_local_steps = t.max_local_steps(),
                  .max_local_seconds = t.max_local_seconds(), .proximal_mu = t.proximal_mu(),
                  .prompt_template = t.prompt_template()};
  if (t.has_hf_base()) {
    // Every trainer builds the decoder by name: the name is the shape's from here on.
    ESTUARY_ASSIGN_OR_RETURN(const models::LlamaConfig config, models::ParseCanonicalShape(t.hf_base().shape()));
    ESTUARY_RETURN_IF_ERROR(models::RegisterHfModel(t.model(), config));
  }
  if (task.update_kind == UpdateKind::kLora) {
    const v1::LoraTask& l = t.lora();
    task.lora.config = {.rank = int(std::min<uint32_t>(l.rank(), 1u << 20)), .alpha = l.alpha(),
                        .dropout = l.dropout(), .target_modules = {l.target_modules().begin(), l.target_modules().end()}};
    task.lora.merge = l.merge();
    task.lora.mixed_ranks = l.mixed_ranks();
    ESTUARY_RETURN_IF_ERROR(task.lora.config.Validate());
  }
  return task;
}

}  // namespace estuary::client
