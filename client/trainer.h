// Trainer: one site's local training, the same code inside estuary-client and
// the in-process simulator.
//
// Given the global weights (a flat buffer and its manifest) and the round's
// task, it trains a model on the site's own examples and returns the update:
// delta = local - global over the same flat layout. Shuffling is seeded by
// (task seed, round, client name), so a rerun produces the same bits.
// The model itself is a per-thread workspace (classifier_backend.h: the CPU or
// a CUDA GPU) reused by every trainer on that thread: a simulator runs thousands of trainers on a few threads, and a fresh
// model per call would cost more in page faults than the training does.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "client/compute.h"
#include "client/task.h"
#include "client/update_stream.h"
#include "models/dataset.h"
#include "models/model.h"

namespace estuary::client {

struct Update {
  UpdateKind kind = UpdateKind::kFull;
  uint64_t num_examples = 0;
  double train_loss = 0;     // mean loss over the last local epoch
  double seconds = 0;        // wall time of local training
  Manifest manifest;
  std::vector<float> payload;
  // Set instead of payload when the delta streams slice by slice
  // (update_stream.h): a ZeRO-3 site. Whoever receives the update must Run
  // it on the trainer's thread, or Cancel and Run it.
  std::shared_ptr<UpdateStream> stream;
};

class Trainer {
 public:
  virtual ~Trainer() = default;

  // The weight of this site's update in the average (examples, or tokens).
  virtual uint64_t num_examples() const = 0;

  // Fails if the task names a model this trainer's data cannot train, the
  // global buffer does not match that model's manifest, the task asks for an
  // update kind this trainer cannot produce, or the hyper-parameters are out
  // of range.
  virtual Result<Update> Train(std::span<const float> global, const Manifest& manifest,
                               const TaskConfig& task, uint64_t round, std::string_view client_name) = 0;
};

// Image classification (the MLP and CNN) on labelled examples.
class ClassifierTrainer : public Trainer {
 public:
  // Trains on all of `data`.
  explicit ClassifierTrainer(models::Dataset data, Compute compute = {});
  // Trains on the examples of a shared dataset at `indices` (a simulated
  // client's shard, without copying it).
  ClassifierTrainer(std::shared_ptr<const models::Dataset> data, std::vector<uint32_t> indices,
                    Compute compute = {});

  uint64_t num_examples() const override { return indices_.size(); }
  Result<Update> Train(std::span<const float> global, const Manifest& manifest, const TaskConfig& task,
                       uint64_t round, std::string_view client_name) override;

 private:
  Compute compute_;
  std::shared_ptr<const models::Dataset> data_;
  std::vector<uint32_t> indices_;  // this trainer's examples within data_
};

Status ValidateTask(const TaskConfig& task);

// An update's header (kind, weight, loss), or an error when the loss is not
// finite: the site diverged, and nothing of it should reach the average.
Result<Update> TrainedUpdate(UpdateKind kind, uint64_t num_examples, double train_loss, uint64_t round);

// The full update of a local training that started at `start` from `global`
// and ended at `local`: delta = local - global, in place. Fails if the loss
// is not finite (the site diverged: nothing of it should reach the average).
Result<Update> FullUpdate(std::vector<float> local, std::span<const float> global, const Manifest& manifest,
                          uint64_t num_examples, double train_loss, std::chrono::steady_clock::time_point start,
                          uint64_t round);

}  // namespace estuary::client
