#include "server/config.h"

#include <algorithm>

#include "models/language_model.h"

namespace estuary::server {

Status ServerConfig::Finalize() {
  std::string host;
  uint16_t port;
  ESTUARY_RETURN_IF_ERROR(ParseHostPort(listen, &host, &port));
  if (checkpoint_dir.empty()) checkpoint_dir = db.string() + ".checkpoints";
  if (spill_dir.empty()) spill_dir = checkpoint_dir;
  if (rounds == 0) return InvalidArgument("config: rounds = 0: must be >= 1");
  if (!(clients_per_round > 0)) return InvalidArgument("config: clients_per_round = {}: must be > 0", clients_per_round);
  if (min_clients == 0) return InvalidArgument("config: min_clients = 0: must be >= 1");
  if (min_updates == 0) return InvalidArgument("config: min_updates = 0: must be >= 1");
  if (!(round_deadline_s > 0)) return InvalidArgument("config: round_deadline = {}: must be > 0", round_deadline_s);
  if (max_frame_bytes < 4096) return InvalidArgument("config: max_frame = {}: must be >= 4096", max_frame_bytes);
  if (chunk_bytes < 4 || chunk_bytes % 4 != 0 || chunk_bytes + 1024 > max_frame_bytes) {
    return InvalidArgument("config: chunk_bytes = {}: must be a multiple of 4 and fit in a frame of {}", chunk_bytes,
                           max_frame_bytes);
  }
  if (staging_slots == 0) return InvalidArgument("config: staging_slots = 0: must be >= 1");
  if (task.epochs() == 0) return InvalidArgument("config: epochs = 0: must be >= 1");
  if (task.batch_size() == 0) return InvalidArgument("config: batch = 0: must be >= 1");
  if (!(task.learning_rate() > 0)) return InvalidArgument("config: lr = {}: must be > 0", task.learning_rate());
  if (!task.optimizer().empty() && task.optimizer() != "sgd" && task.optimizer() != "adamw") {
    return InvalidArgument("config: optimizer = '{}': expected sgd or adamw", task.optimizer());
  }
  if (task.seq_len() == 0) return InvalidArgument("config: seq_len = 0: must be >= 1");
  if (task.update_kind() == v1::UPDATE_LORA) {
    ESTUARY_RETURN_IF_ERROR(LoraOptionsOf(task).status());
  } else if (!base_model.empty()) {
    return InvalidArgument("config: base_model = {}: only a lora federation starts from a base model",
                           base_model.string());
  }
  return Status::Ok();
}

Result<aggregation::LoraStrategyOptions> LoraOptionsOf(const v1::TaskConfig& task) {
  if (!models::IsLanguageModel(task.model())) {
    return InvalidArgument("config: update_kind = lora needs a language model (llama-*), not '{}'", task.model());
  }
  const v1::LoraTask& l = task.lora();
  models::LoraConfig lora;
  lora.rank = int(std::min<uint32_t>(l.rank(), 1u << 20));
  lora.alpha = l.alpha();
  lora.dropout = l.dropout();
  lora.target_modules.assign(l.target_modules().begin(), l.target_modules().end());
  if (Status valid = lora.Validate(); !valid.ok()) return InvalidArgument("config: {}", valid.message());
  aggregation::LoraStrategyOptions options;
  auto rule = aggregation::ParseLoraMergeRule(l.merge());
  if (!rule.ok()) return InvalidArgument("config: lora_merge = '{}': {}", l.merge(), rule.status().message());
  options.merge.rule = *rule;
  options.merge.rank = size_t(lora.rank);
  options.merge.alpha = lora.alpha;
  options.mixed_ranks = l.mixed_ranks();
  ESTUARY_ASSIGN_OR_RETURN(const models::LlamaConfig config, models::LlamaPreset(task.model()));
  ESTUARY_ASSIGN_OR_RETURN(options.layout, models::MakeLoraGlobalLayout(config, lora));
  if (Status valid = aggregation::ValidateLoraStrategyOptions(options); !valid.ok()) {
    return InvalidArgument("config: {}", valid.message());
  }
  return options;
}

}  // namespace estuary::server
