// The federation's start, shared by both round drivers (recover.h), and the
// synchronous Coordinator's use of it.
#include <spdlog/spdlog.h>

#include "aggregation/federation.h"
#include "crypto/sha256.h"
#include "crypto/transfer_digest.h"
#include "models/custom_model.h"
#include "server/coordinator.h"
#include "server/recover.h"

namespace estuary::server {

Result<RecoveredFederation> RecoverFederation(const ServerConfig& config, Store& store) {
  RecoveredFederation out;
  // Evaluation runs between rounds, when the clients are idle: two threads.
  // Distributed DP noises on the sites: the server's strategy adds none.
  v1::FederationConfig strategy_federation = config.federation;
  if (config.distributed_dp()) strategy_federation.clear_dp();
  ESTUARY_ASSIGN_OR_RETURN(aggregation::Federation federation,
                           aggregation::MakeFederation(strategy_federation, {.data = config.eval_data,
                                                                             .tokenizer = config.tokenizer,
                                                                             .threads = 2}));
  out.task = federation.config.task();
  out.lora = std::move(federation.lora);
  out.manifest = federation.manifest;
  out.held_base = federation.held_base;
  const v1::TaskConfig& task = out.task;
  const Manifest& manifest = out.manifest;
  ESTUARY_ASSIGN_OR_RETURN(auto stored_model, store.GetMeta("model"));
  if (stored_model && *stored_model != task.model() && task.has_hf_base()) {
    // The name holds the base's directory name and identity: another base, or the same one renamed.
    return FailedPrecondition("server: {} holds a federation on base model {}, not {} ({}, sha256 {}): start it on "
                              "the base it began with",
                              config.db.string(), *stored_model, config.federation.base_model(), task.model(),
                              task.hf_base().sha256());
  }
  if (stored_model && *stored_model != task.model()) {
    return FailedPrecondition("server: {} holds a federation of model '{}', not '{}'", config.db.string(),
                              *stored_model, task.model());
  }
  if (const v1::DpConfig& dp = config.federation.dp(); dp.noise_multiplier() > 0) {
    ESTUARY_ASSIGN_OR_RETURN(out.accountant, privacy::Accountant::Create(dp.delta()));
    ESTUARY_ASSIGN_OR_RETURN(const std::vector<RoundRecord> rounds, store.Rounds());
    for (const RoundRecord& r : rounds) {
      if (r.state != RoundState::kCommitted) continue;
      if (!r.privacy) {
        return FailedPrecondition("server: {}: round {} committed without differential privacy; a federation cannot "
                                  "turn it on midway",
                                  config.db.string(), r.round);
      }
      if (!r.secagg) {
        ESTUARY_RETURN_IF_ERROR(out.accountant->AddRounds(r.privacy->sampling_rate, r.privacy->noise_multiplier));
        continue;
      }
      // Distributed DP: the round's plan again, from the settings and the
      // logged protocol, charged with the inputs its sum held.
      if (!config.distributed_dp()) {
        return FailedPrecondition("server: {}: round {} committed under distributed DP; restart with --dp distributed",
                                  config.db.string(), r.round);
      }
      const uint64_t dimension =
          out.lora ? aggregation::ExpectedLoraUpload(*out.lora).total_elements : out.manifest.total_elements;
      ESTUARY_ASSIGN_OR_RETURN(const privacy::DistributedDpPlan plan,
                               DistributedDpPlanFor(config, r.secagg->sites, dimension));
      if (plan.scale != r.secagg->scale || r.privacy->clip != dp.clip() ||
          r.privacy->noise_multiplier != dp.noise_multiplier()) {
        return FailedPrecondition("server: {}: round {} ran distributed DP at scale {}, clip {}, noise multiplier {}; "
                                  "these settings plan scale {}, clip {}, noise multiplier {}: restart with the "
                                  "federation's dp settings",
                                  config.db.string(), r.round, r.secagg->scale, r.privacy->clip,
                                  r.privacy->noise_multiplier, plan.scale, dp.clip(), dp.noise_multiplier());
      }
      ESTUARY_ASSIGN_OR_RETURN(const auto rdp, privacy::DistributedDpRoundRdp(plan, r.updates_received,
                                                                              r.privacy->sampling_rate,
                                                                              out.accountant->orders()));
      ESTUARY_RETURN_IF_ERROR(out.accountant->AddRoundRdp(rdp));
    }
  } else {
    // Without this a restart that forgot its --dp flags would go on in the clear
    // and report no ε, as if the earlier rounds had spent none.
    ESTUARY_ASSIGN_OR_RETURN(const std::vector<RoundRecord> rounds, store.Rounds());
    for (const RoundRecord& r : rounds) {
      if (r.state != RoundState::kCommitted || !r.privacy) continue;
      return FailedPrecondition("server: {}: round {} committed under differential privacy (noise multiplier {}); "
                                "restart with the federation's dp settings: it cannot turn them off midway",
                                config.db.string(), r.round, r.privacy->noise_multiplier);
    }
  }
  ESTUARY_ASSIGN_OR_RETURN(auto last, store.LastCommittedRound());
  ESTUARY_ASSIGN_OR_RETURN(auto stored_mode, store.GetMeta("mode"));
  const std::string logged_mode = stored_mode && !stored_mode->empty() ? *stored_mode : "sync";
  if (last && logged_mode != config.mode) {
    // A version is not a round: the log's rows and the checkpoints mean another thing in the other mode.
    return FailedPrecondition("server: {} holds a federation of mode {} (committed up to round {}): restart it with "
                              "--mode {}",
                              config.db.string(), logged_mode, last->round, logged_mode);
  }
  Checkpointer::LogView log{.path = config.db.string(), .last_committed = last ? last->round : 0};
  ESTUARY_ASSIGN_OR_RETURN(log.federation_id, store.GetMeta("federation_id"));
  ESTUARY_ASSIGN_OR_RETURN(Checkpointer checkpointer,
                           Checkpointer::Open(config.checkpoint_dir, task, out.lora, log,
                                              task.has_hf_base() ? config.federation.base_model() : "",
                                              federation.custom ? models::CustomModelMetadata(*federation.custom)
                                                                : std::map<std::string, std::string>{}));
  for (const auto& name : checkpointer.removed()) {
    spdlog::info("removed {} from {}: left by a write or a round that never committed", name,
                 config.checkpoint_dir.string());
  }
  out.federation_id = checkpointer.federation_id();
  ESTUARY_RETURN_IF_ERROR(store.SetMeta("federation_id", out.federation_id));
  ESTUARY_RETURN_IF_ERROR(store.SetMeta("model", task.model()));
  ESTUARY_RETURN_IF_ERROR(store.SetMeta("strategy", config.federation.strategy().name()));
  ESTUARY_RETURN_IF_ERROR(store.SetMeta("mode", config.mode));
  // For `rounds watch`: the rounds planned, and not complete until they are (a restart may plan more).
  ESTUARY_RETURN_IF_ERROR(store.SetMeta("rounds", std::to_string(config.rounds)));
  ESTUARY_RETURN_IF_ERROR(store.SetMeta("complete", ""));
  out.aggregator = std::make_unique<Aggregator>(std::move(federation.strategy), std::move(federation.bound),
                                                std::move(federation.evaluator), std::move(checkpointer), manifest);
  if (federation.custom) out.custom_description = models::DescribeCustomModel(*federation.custom);
  if (!last) {
    auto initial = std::make_shared<const std::vector<float>>(std::move(federation.initial));
    const size_t bytes = initial->size() * sizeof(float);
    out.model = {.values = initial,
                 .checksum = crypto::Sha256Hex(initial->data(), bytes),
                 .version = 0,
                 .digest = crypto::TransferDigestHex(initial->data(), bytes)};
    return out;
  }
  ESTUARY_ASSIGN_OR_RETURN(auto path, store.CheckpointFor(last->round));
  if (!path) return FailedPrecondition("server: round {} is committed but has no checkpoint row", last->round);
  ESTUARY_ASSIGN_OR_RETURN(std::vector<float> global, out.aggregator->Restore(*path, last->global_checksum));
  // Restore checked the checkpoint against the logged checksum.
  const std::string digest = crypto::TransferDigestHex(global.data(), global.size() * sizeof(float));
  out.model = {.values = std::make_shared<const std::vector<float>>(std::move(global)),
               .checksum = last->global_checksum,
               .version = last->model_version,
               .digest = digest};
  out.last = std::move(last);
  return out;
}

Status Coordinator::Recover() {
  ESTUARY_ASSIGN_OR_RETURN(RecoveredFederation recovered, RecoverFederation(config_, store_));
  task_ = std::move(recovered.task);
  lora_ = std::move(recovered.lora);
  manifest_ = std::move(recovered.manifest);
  distribution_.SetHeldBase(std::move(recovered.held_base));
  aggregator_ = std::move(recovered.aggregator);
  federation_id_ = std::move(recovered.federation_id);
  accountant_ = std::move(recovered.accountant);
  const GlobalModel& model = recovered.model;
  distribution_.Reset(manifest_, model);
  // SCAFFOLD's c: zeros in a new federation, else as checkpointed.
  ESTUARY_ASSIGN_OR_RETURN(auto control, aggregator_->Control());
  distribution_.SetControl(std::move(control));
  round_ = recovered.last ? recovered.last->round + 1 : 1;
  ESTUARY_RETURN_IF_ERROR(CountFailedTries());
  if (!recovered.last) {
    spdlog::info("new federation {}: model {} ({} parameters), checksum {}", federation_id_, task_.model(),
                 manifest_.total_elements, model.checksum.substr(0, 12));
  } else {
    spdlog::info("federation {} resumed after round {}: model version {}, checksum {}", federation_id_,
                 recovered.last->round, model.version, model.checksum.substr(0, 12));
  }
  if (!recovered.custom_description.empty()) spdlog::info("{}", recovered.custom_description);
  return Status::Ok();
}

}  // namespace estuary::server
