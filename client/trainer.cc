#include "client/trainer.h"

#include <chrono>
#include <map>
#include <cmath>
#include <cstring>
#include <numeric>

#include "client/batch_schedule.h"
#include "client/classifier_backend.h"

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

Status ValidateTask(const TaskConfig& task) {
  if (task.epochs == 0 || task.epochs > 1000) return InvalidArgument("task: epochs {} not in [1, 1000]", task.epochs);
  if (task.batch_size == 0 || task.batch_size > 65536) {
    return InvalidArgument("task: batch size {} not in [1, 65536]", task.batch_size);
  }
  if (!(task.learning_rate > 0) || !std::isfinite(task.learning_rate)) {
    return InvalidArgument("task: learning rate {} must be a positive number", task.learning_rate);
  }
  if (!(task.momentum >= 0 && task.momentum < 1)) return InvalidArgument("task: momentum {} not in [0, 1)", task.momentum);
  if (!(task.weight_decay >= 0) || !std::isfinite(task.weight_decay)) {
    return InvalidArgument("task: weight decay {} must be >= 0", task.weight_decay);
  }
  if (task.seq_len == 0 || task.seq_len > 65536) return InvalidArgument("task: seq_len {} not in [1, 65536]", task.seq_len);
  return Status::Ok();
}

ClassifierTrainer::ClassifierTrainer(models::Dataset data, Compute compute)
    : compute_(compute), data_(std::make_shared<const models::Dataset>(std::move(data))), indices_(data_->size()) {
  std::iota(indices_.begin(), indices_.end(), 0u);
}

ClassifierTrainer::ClassifierTrainer(std::shared_ptr<const models::Dataset> data, std::vector<uint32_t> indices,
                                     Compute compute)
    : compute_(compute), data_(std::move(data)), indices_(std::move(indices)) {}

Result<Update> ClassifierTrainer::Train(std::span<const float> global, const Manifest& manifest,
                              const TaskConfig& task, uint64_t round, std::string_view client_name) {
  ESTUARY_RETURN_IF_ERROR(ValidateTask(task));
  if (task.optimizer != OptimizerKind::kSgd) {
    return InvalidArgument("task: model '{}' trains with sgd, not {}", task.model, OptimizerName(task.optimizer));
  }
  if (task.update_kind != UpdateKind::kFull) {
    return InvalidArgument("task: update kind lora needs a model with adapters; '{}' has none", task.model);
  }
  if (indices_.empty()) return FailedPrecondition("trainer: no local examples");
  ESTUARY_ASSIGN_OR_RETURN(ClassifierBackend * backend,
                           ThreadClassifierBackend(task.model, int(task.batch_size), compute_));
  if (!(backend->manifest() == manifest) || global.size() != manifest.total_elements) {
    return InvalidArgument("trainer: the global model's manifest does not match model '{}'", task.model);
  }
  if (data_->feature_size != backend->input_size()) {
    return InvalidArgument("trainer: examples have {} features, model '{}' wants {}", data_->feature_size,
                           task.model, backend->input_size());
  }
  const auto start = std::chrono::steady_clock::now();
  ESTUARY_RETURN_IF_ERROR(backend->Begin(global, task));
  const int features = data_->feature_size;
  thread_local std::vector<float> batch_x;
  thread_local std::vector<int32_t> batch_y;
  batch_x.resize(size_t{task.batch_size} * features);
  batch_y.resize(task.batch_size);

  double epoch_loss = 0;  // over the last epoch's examples (all of them, unless max_local_steps cut it)
  uint64_t epoch_examples = 0;
  BatchSchedule schedule(indices_, task, round, client_name);
  while (schedule.Next()) {
    if (schedule.starts_epoch()) epoch_loss = 0, epoch_examples = 0;
    const std::span<const uint32_t> batch = schedule.batch();
    for (size_t i = 0; i < batch.size(); ++i) {
      std::memcpy(batch_x.data() + i * features, data_->row(batch[i]), features * sizeof(float));
      batch_y[i] = data_->labels[batch[i]];
    }
    const int n = int(batch.size());
    ESTUARY_ASSIGN_OR_RETURN(const float loss, backend->Step(batch_x.data(), batch_y.data(), n));
    epoch_loss += double(loss) * n;
    epoch_examples += uint64_t(n);
  }

  std::vector<float> local(global.size());
  ESTUARY_RETURN_IF_ERROR(backend->Finish(local));
  return FullUpdate(std::move(local), global, manifest, indices_.size(), epoch_loss / double(epoch_examples), start,
                    round);
}

}  // namespace estuary::client
