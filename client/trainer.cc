#include "client/trainer.h"

#include <chrono>
#include <cmath>

namespace estuary::client {

Result<Update> TrainedUpdate(UpdateKind kind, uint64_t num_examples, double train_loss, uint64_t round) {
  if (!std::isfinite(train_loss)) {
    return FailedPrecondition("trainer: local training diverged (loss {}) in round {}", train_loss, round);
  }
  Update update;
  update.kind = kind;
  update.num_examples = num_examples;
  update.train_loss = train_loss;
  return update;
}

Result<Update> FullUpdate(std::vector<float> local, std::span<const float> global, const Manifest& manifest,
                          uint64_t num_examples, double train_loss, std::chrono::steady_clock::time_point start,
                          uint64_t round) {
  ESTUARY_ASSIGN_OR_RETURN(Update update, TrainedUpdate(UpdateKind::kFull, num_examples, train_loss, round));
  update.manifest = manifest;
  update.payload = std::move(local);
  float* delta = update.payload.data();
  for (size_t i = 0; i < global.size(); ++i) delta[i] -= global[i];
  update.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return update;
}

}  // namespace estuary::client
