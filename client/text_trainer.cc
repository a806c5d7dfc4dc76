#include "client/text_trainer.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>

#include "client/batch_schedule.h"
#include "client/lm_backend.h"
#include "models/language_model.h"

namespace estuary::client {

TextTrainer::TextTrainer(std::shared_ptr<const std::vector<int32_t>> tokens, Compute compute)
    : tokens_(std::move(tokens)), compute_(compute) {}

Result<Update> TextTrainer::Train(std::span<const float> global, const models::Manifest& manifest,
                                  const TaskConfig& task, uint64_t round, std::string_view client_name) {
  ESTUARY_RETURN_IF_ERROR(ValidateTask(task));
  if (!models::IsLanguageModel(task.model)) {
    return InvalidArgument("task: model '{}' is not a language model; this site holds text", task.model);
  }
  if (task.update_kind != UpdateKind::kFull) {
    return InvalidArgument("task: update kind lora is not available for '{}' yet", task.model);
  }
  const int seq = static_cast<int>(task.seq_len);
  const uint64_t windows = tokens_->empty() ? 0 : (tokens_->size() - 1) / uint64_t(seq);
  if (windows == 0) {
    return FailedPrecondition("trainer: {} local tokens hold no window of {} + 1", tokens_->size(), seq);
  }
  ESTUARY_ASSIGN_OR_RETURN(LmBackend * backend, ThreadLmBackend(task.model, int(task.batch_size), compute_));
  if (!(backend->manifest() == manifest) || global.size() != manifest.total_elements) {
    return InvalidArgument("trainer: the global model's manifest does not match model '{}'", task.model);
  }
  if (seq > backend->max_seq_len()) {
    return InvalidArgument("task: seq_len {} exceeds {}'s context of {}", seq, task.model, backend->max_seq_len());
  }
  const auto start = std::chrono::steady_clock::now();
  ESTUARY_RETURN_IF_ERROR(backend->Begin(global, task));
  std::vector<uint32_t> order(windows);
  std::iota(order.begin(), order.end(), 0u);
  thread_local std::vector<int32_t> inputs, targets;
  inputs.resize(size_t(task.batch_size) * seq);
  targets.resize(inputs.size());

  double loss_sum = 0;  // over the last epoch's tokens
  uint64_t loss_tokens = 0;
  BatchSchedule schedule(std::move(order), task, round, client_name);
  while (schedule.Next()) {
    if (schedule.starts_epoch()) loss_sum = 0, loss_tokens = 0;
    const std::span<const uint32_t> batch = schedule.batch();
    for (size_t b = 0; b < batch.size(); ++b) {
      const int32_t* window = tokens_->data() + size_t(batch[b]) * seq;
      std::memcpy(inputs.data() + b * seq, window, seq * sizeof(int32_t));
      std::memcpy(targets.data() + b * seq, window + 1, seq * sizeof(int32_t));
    }
    const int n = int(batch.size());
    ESTUARY_ASSIGN_OR_RETURN(const float loss, backend->Step(inputs.data(), targets.data(), n, seq));
    loss_sum += double(loss) * n * seq;
    loss_tokens += uint64_t(n) * seq;
  }

  std::vector<float> local(global.size());
  ESTUARY_RETURN_IF_ERROR(backend->Finish(local));
  return FullUpdate(std::move(local), global, manifest, num_examples(), loss_sum / double(loss_tokens), start, round);
}

}  // namespace estuary::client
