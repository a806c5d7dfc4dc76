#include "client/text_trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <numeric>

#include "client/batch_schedule.h"
#include "client/lm_backend.h"
#include "client/lora_round.h"
#include "client/rank_model.h"
#include "models/language_model.h"

namespace estuary::client {

TextTrainer::TextTrainer(std::shared_ptr<const std::vector<int32_t>> tokens, Compute compute)
    : tokens_(std::move(tokens)), compute_(compute) {}

namespace {

// This thread's adapted model for (model, batch, adapter config, device):
// built once, reused by every round and client it trains on this thread.
Result<RankLoraDecoder*> ThreadLoraDecoder(const std::string& model, int batch, const models::LoraConfig& lora,
                                           const Compute& compute, DType base) {
  thread_local std::map<std::string, std::unique_ptr<RankLoraDecoder>> decoders;
  const std::string key = fmt::format("{}/{}/{}/{}/{}", model, batch, LoraConfigKey(lora), compute.ToString(),
                                      DTypeName(base));
  auto& slot = decoders[key];
  if (!slot) {
    auto made = compute.device == Device::kCpu
                    ? MakeCpuRankLoraDecoder(model, batch, lora)
                    : MakeCudaRankLoraDecoder(model, batch, lora, compute, /*stream=*/nullptr);
    const Status kept = made.ok() ? (*made)->KeepBaseIn(base) : made.status();
    if (!kept.ok()) {
      decoders.erase(key);
      return kept;
    }
    slot = std::move(made).value();
  }
  return slot.get();
}

}  // namespace

double TextTrainer::RunSchedule(const TaskConfig& task, uint64_t round, std::string_view client_name, int seq,
                                const std::function<Result<float>(const int32_t*, const int32_t*, int)>& step,
                                Status* status) const {
  const uint64_t windows = (tokens_->size() - 1) / uint64_t(seq);
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
    Result<float> loss = step(inputs.data(), targets.data(), n);
    if (!loss.ok()) {
      *status = loss.status();
      return 0;
    }
    loss_sum += double(*loss) * n * seq;
    loss_tokens += uint64_t(n) * seq;
  }
  *status = Status::Ok();
  return loss_sum / double(loss_tokens);
}

Result<Update> TextTrainer::Train(std::span<const float> global, const Manifest& manifest,
                                  const TaskConfig& task, uint64_t round, std::string_view client_name) {
  ESTUARY_RETURN_IF_ERROR(ValidateTask(task));
  if (!models::IsLanguageModel(task.model)) {
    return InvalidArgument("task: model '{}' is not a language model; this site holds text", task.model);
  }
  const int seq = static_cast<int>(task.seq_len);
  const uint64_t windows = tokens_->empty() ? 0 : (tokens_->size() - 1) / uint64_t(seq);
  if (windows == 0) {
    return FailedPrecondition("trainer: {} local tokens hold no window of {} + 1", tokens_->size(), seq);
  }
  if (task.update_kind == UpdateKind::kLora) return TrainLora(global, manifest, task, round, client_name);
  ESTUARY_ASSIGN_OR_RETURN(LmBackend * backend, ThreadLmBackend(task.model, int(task.batch_size), compute_));
  if (!(backend->manifest() == manifest) || global.size() != manifest.total_elements) {
    return InvalidArgument("trainer: the global model's manifest does not match model '{}'", task.model);
  }
  if (seq > backend->max_seq_len()) {
    return InvalidArgument("task: seq_len {} exceeds {}'s context of {}", seq, task.model, backend->max_seq_len());
  }
  const auto start = std::chrono::steady_clock::now();
  ESTUARY_RETURN_IF_ERROR(backend->Begin(global, task));
  Status status;
  const double loss = RunSchedule(
      task, round, client_name, seq,
      [&](const int32_t* inputs, const int32_t* targets, int n) { return backend->Step(inputs, targets, n, seq); },
      &status);
  ESTUARY_RETURN_IF_ERROR(status);
  std::vector<float> local(global.size());
  ESTUARY_RETURN_IF_ERROR(backend->Finish(local));
  return FullUpdate(std::move(local), global, manifest, num_examples(), loss, start, round);
}

// The round a rank of a multi-rank site trains (client/site.cc), on one
// rank: the same plan, start and upload, and the same DataParallel step over
// a communicator of one.
Result<Update> TextTrainer::TrainLora(std::span<const float> global, const Manifest& manifest,
                                      const TaskConfig& task, uint64_t round, std::string_view client_name) {
  ESTUARY_ASSIGN_OR_RETURN(const LoraRound plan, PlanLoraRound(task, lora_rank_));
  ESTUARY_RETURN_IF_ERROR(CheckLoraGlobal(plan, task, manifest, global.size()));
  ESTUARY_ASSIGN_OR_RETURN(RankLoraDecoder * model,
                           ThreadLoraDecoder(task.model, int(task.batch_size), plan.site, compute_, lora_base_));
  const int seq = static_cast<int>(task.seq_len);
  const auto start = std::chrono::steady_clock::now();
  ESTUARY_ASSIGN_OR_RETURN(const LoraStart from, StartLoraRound(plan, global, task, round, client_name));
  ESTUARY_RETURN_IF_ERROR(model->LoadBase(from.base(), from.dropout_seed));
  model->SetFirstRow(0);
  thread_local std::unique_ptr<comm::Communicator> cpu_solo, gpu_solo;
  auto& solo = compute_.device == Device::kCpu ? cpu_solo : gpu_solo;
  if (!solo) solo = comm::MakeSoloCommunicator(compute_.device);
  ESTUARY_ASSIGN_OR_RETURN(auto dp, model->StartRound(*solo, from.adapter, task, {.broadcast_parameters = false}));
  Status status;
  const double loss = RunSchedule(
      task, round, client_name, seq,
      [&](const int32_t* inputs, const int32_t* targets, int n) -> Result<float> {
        ESTUARY_ASSIGN_OR_RETURN(const float l,
                                 model->ForwardBackward(inputs, targets, n, seq, dp->MicroBatch(1.0, true)));
        ESTUARY_RETURN_IF_ERROR(
            dp->Step([&](std::span<const models::ParameterSlice> s) { model->OptimizerStep(s); }).status());
        ESTUARY_RETURN_IF_ERROR(model->FinishStep());
        return l;
      },
      &status);
  ESTUARY_RETURN_IF_ERROR(status);
  std::vector<float> trained(plan.site_layout.manifest.total_elements);
  ESTUARY_RETURN_IF_ERROR(model->ReadOut(*dp, [&](uint64_t offset, std::span<const float> values) {
    std::copy(values.begin(), values.end(), trained.begin() + offset);
    return Status::Ok();
  }));
  return LoraUpdateOf(plan, global, trained, num_examples(), loss, start, round);
}

}  // namespace estuary::client
