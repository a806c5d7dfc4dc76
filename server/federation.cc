#include "server/federation.h"

#include "models/lora_federation.h"

namespace estuary::server {

Result<Federation> BuildFederation(const ServerConfig& config) {
  Federation federation;
  models::InitialWeights& initial = federation.initial;
  if (config.task.update_kind() == v1::UPDATE_LORA) {
    // The global model is the base followed by the global adapter
    // (models/lora_federation.h); the strategy merges the sites' adapters.
    ESTUARY_ASSIGN_OR_RETURN(federation.lora, LoraOptionsOf(config.task));
    models::LoraConfig lora;
    lora.rank = int(federation.lora->merge.rank);
    lora.alpha = federation.lora->merge.alpha;
    lora.target_modules.assign(config.task.lora().target_modules().begin(),
                               config.task.lora().target_modules().end());
    ESTUARY_ASSIGN_OR_RETURN(initial,
                             models::LoraInitialModel(config.task.model(), lora, config.seed, config.base_model));
    if (!(initial.manifest == federation.lora->layout.global)) {
      return Internal("server: the LoRA initial model's layout differs from the strategy's");
    }
    ESTUARY_ASSIGN_OR_RETURN(federation.strategy, aggregation::LoraStrategy::Make(*federation.lora));
  } else {
    ESTUARY_ASSIGN_OR_RETURN(initial, models::InitialModel(config.task.model(), config.seed));
    ESTUARY_ASSIGN_OR_RETURN(federation.strategy, aggregation::MakeStrategy(config.strategy));
  }
  if (!config.eval_data.empty()) {
    // Evaluation runs between rounds, when the clients are idle: two threads.
    ESTUARY_ASSIGN_OR_RETURN(federation.evaluator,
                             models::MakeEvaluator(config.task.model(), config.eval_data,
                                                   {.threads = 2,
                                                    .seq_len = int(config.task.seq_len()),
                                                    .max_windows = config.eval_windows,
                                                    .seed = config.seed}));
    if (federation.lora) {
      federation.evaluator = models::MakeLoraEvaluator(std::move(federation.evaluator), federation.lora->layout,
                                                       federation.lora->merge.alpha);
    }
  }
  return federation;
}

}  // namespace estuary::server
