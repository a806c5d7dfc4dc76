// Trainer: one site's local training, the same code inside estuary-client and
// the in-process simulator.
//
// Given the global weights (a flat buffer and its manifest) and the round's
// task, it trains a model on the site's own examples and returns the update:
// delta = local - global over the same flat layout. Shuffling is seeded by
// (task seed, round, client name), so a rerun produces the same bits.
// The model itself is a per-thread workspace reused by every trainer on that
// thread: a simulator runs thousands of trainers on a few threads, and a fresh
// model per call would cost more in page faults than the training does.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "models/dataset.h"
#include "models/model.h"

namespace estuary::client {

enum class UpdateKind { kFull = 0, kLora = 1 };

struct TaskConfig {
  std::string model = "mlp";
  uint32_t epochs = 5;
  uint32_t batch_size = 10;
  float learning_rate = 0.05f;
  float momentum = 0.0f;
  float weight_decay = 0.0f;
  UpdateKind update_kind = UpdateKind::kFull;
  uint64_t seed = 0;
};

struct Update {
  UpdateKind kind = UpdateKind::kFull;
  uint64_t num_examples = 0;
  double train_loss = 0;     // mean loss over the last local epoch
  double seconds = 0;        // wall time of local training
  models::Manifest manifest;
  std::vector<float> payload;
};

class Trainer {
 public:
  // Trains on all of `data`.
  explicit Trainer(models::Dataset data);
  // Trains on the examples of a shared dataset at `indices` (a simulated
  // client's shard, without copying it).
  Trainer(std::shared_ptr<const models::Dataset> data, std::vector<uint32_t> indices);

  uint64_t num_examples() const { return indices_.size(); }

  // Fails if the task names an unknown model, the global buffer does not
  // match that model's manifest, the task asks for an update kind this
  // trainer cannot produce, or the hyper-parameters are out of range.
  Result<Update> Train(std::span<const float> global, const models::Manifest& manifest,
                       const TaskConfig& task, uint64_t round, std::string_view client_name);

 private:
  std::shared_ptr<const models::Dataset> data_;
  std::vector<uint32_t> indices_;  // this trainer's examples within data_
};

Status ValidateTask(const TaskConfig& task);

}  // namespace estuary::client
