// The Coordinator's start: the federation built, the round log checked
// against it (a DP federation replays its ε; one without DP refuses a log
// that had it) and the last committed round's checkpoint loaded.
#include <spdlog/spdlog.h>

#include "aggregation/federation.h"
#include "crypto/sha256.h"
#include "models/custom_model.h"
#include "server/coordinator.h"

namespace estuary::server {

Status Coordinator::Recover() {
  // Evaluation runs between rounds, when the clients are idle: two threads.
  ESTUARY_ASSIGN_OR_RETURN(aggregation::Federation federation,
                           aggregation::MakeFederation(config_.federation, {.data = config_.eval_data,
                                                                             .tokenizer = config_.tokenizer,
                                                                             .threads = 2}));
  task_ = federation.config.task();
  lora_ = std::move(federation.lora);
  manifest_ = federation.manifest;
  distribution_.SetHeldBase(federation.held_base);
  ESTUARY_ASSIGN_OR_RETURN(auto stored_model, store_.GetMeta("model"));
  if (stored_model && *stored_model != task_.model() && task_.has_hf_base()) {
    // The name holds the base's directory name and identity: another base, or the same one renamed.
    return FailedPrecondition("server: {} holds a federation on base model {}, not {} ({}, sha256 {}): start it on "
                              "the base it began with",
                              config_.db.string(), *stored_model, config_.federation.base_model(), task_.model(),
                              task_.hf_base().sha256());
  }
  if (stored_model && *stored_model != task_.model()) {
    return FailedPrecondition("server: {} holds a federation of model '{}', not '{}'", config_.db.string(),
                              *stored_model, task_.model());
  }
  if (const v1::DpConfig& dp = config_.federation.dp(); dp.noise_multiplier() > 0) {
    ESTUARY_ASSIGN_OR_RETURN(accountant_, privacy::Accountant::Create(dp.delta()));
    ESTUARY_ASSIGN_OR_RETURN(const std::vector<RoundRecord> rounds, store_.Rounds());
    for (const RoundRecord& r : rounds) {
      if (r.state != RoundState::kCommitted) continue;
      if (!r.privacy) {
        return FailedPrecondition("server: {}: round {} committed without differential privacy; a federation cannot "
                                  "turn it on midway",
                                  config_.db.string(), r.round);
      }
      ESTUARY_RETURN_IF_ERROR(accountant_->AddRounds(r.privacy->sampling_rate, r.privacy->noise_multiplier));
    }
  } else {
    // Without this a restart that forgot its --dp flags would go on in the clear
    // and report no ε, as if the earlier rounds had spent none.
    ESTUARY_ASSIGN_OR_RETURN(const std::vector<RoundRecord> rounds, store_.Rounds());
    for (const RoundRecord& r : rounds) {
      if (r.state != RoundState::kCommitted || !r.privacy) continue;
      return FailedPrecondition("server: {}: round {} committed under differential privacy (noise multiplier {}); "
                                "restart with the federation's dp settings: it cannot turn them off midway",
                                config_.db.string(), r.round, r.privacy->noise_multiplier);
    }
  }
  ESTUARY_ASSIGN_OR_RETURN(auto last, store_.LastCommittedRound());
  Checkpointer::LogView log{.path = config_.db.string(), .last_committed = last ? last->round : 0};
  ESTUARY_ASSIGN_OR_RETURN(log.federation_id, store_.GetMeta("federation_id"));
  ESTUARY_ASSIGN_OR_RETURN(Checkpointer checkpointer,
                           Checkpointer::Open(config_.checkpoint_dir, task_, lora_, log,
                                              task_.has_hf_base() ? config_.federation.base_model() : "",
                                              federation.custom ? models::CustomModelMetadata(*federation.custom)
                                                                : std::map<std::string, std::string>{}));
  for (const auto& name : checkpointer.removed()) {
    spdlog::info("removed {} from {}: left by a write or a round that never committed", name,
                 config_.checkpoint_dir.string());
  }
  federation_id_ = checkpointer.federation_id();
  ESTUARY_RETURN_IF_ERROR(store_.SetMeta("federation_id", federation_id_));
  ESTUARY_RETURN_IF_ERROR(store_.SetMeta("model", task_.model()));
  ESTUARY_RETURN_IF_ERROR(store_.SetMeta("strategy", config_.federation.strategy().name()));
  // For `rounds watch`: the rounds planned, and not complete until they are (a restart may plan more).
  ESTUARY_RETURN_IF_ERROR(store_.SetMeta("rounds", std::to_string(config_.rounds)));
  ESTUARY_RETURN_IF_ERROR(store_.SetMeta("complete", ""));
  aggregator_ = std::make_unique<Aggregator>(std::move(federation.strategy), std::move(federation.bound),
                                             std::move(federation.evaluator), std::move(checkpointer), manifest_);

  if (!last) {
    auto initial = std::make_shared<const std::vector<float>>(std::move(federation.initial));
    const std::string checksum = crypto::Sha256Hex(initial->data(), initial->size() * sizeof(float));
    distribution_.Reset(manifest_, {std::move(initial), checksum, 0});
    ESTUARY_ASSIGN_OR_RETURN(auto control, aggregator_->Control());  // SCAFFOLD's c: zeros
    distribution_.SetControl(std::move(control));
    round_ = 1;
    ESTUARY_RETURN_IF_ERROR(CountFailedTries());
    spdlog::info("new federation {}: model {} ({} parameters), checksum {}", federation_id_, task_.model(),
                 manifest_.total_elements, checksum.substr(0, 12));
    if (federation.custom) spdlog::info("{}", models::DescribeCustomModel(*federation.custom));
    return Status::Ok();
  }
  ESTUARY_ASSIGN_OR_RETURN(auto path, store_.CheckpointFor(last->round));
  if (!path) return FailedPrecondition("server: round {} is committed but has no checkpoint row", last->round);
  ESTUARY_ASSIGN_OR_RETURN(std::vector<float> global, aggregator_->Restore(*path, last->global_checksum));
  distribution_.Reset(manifest_, {std::make_shared<const std::vector<float>>(std::move(global)),
                                  last->global_checksum, last->model_version});
  ESTUARY_ASSIGN_OR_RETURN(auto control, aggregator_->Control());  // SCAFFOLD's c, as checkpointed
  distribution_.SetControl(std::move(control));
  round_ = last->round + 1;
  ESTUARY_RETURN_IF_ERROR(CountFailedTries());
  spdlog::info("federation {} resumed after round {}: model version {}, checksum {}", federation_id_, last->round,
               last->model_version, last->global_checksum.substr(0, 12));
  if (federation.custom) spdlog::info("{}", models::DescribeCustomModel(*federation.custom));
  return Status::Ok();
}

}  // namespace estuary::server
