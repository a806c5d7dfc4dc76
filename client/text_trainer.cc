#include "client/text_trainer.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <random>
#include <cmath>
#include <cstring>
#include <numeric>

#include "base/seed.h"
#include "client/batch_schedule.h"
#include "client/lm_backend.h"
#include "models/language_model.h"
#include "models/lora_federation.h"
#include "models/optimizer.h"

namespace estuary::client {

TextTrainer::TextTrainer(std::shared_ptr<const std::vector<int32_t>> tokens, Compute compute)
    : tokens_(std::move(tokens)), compute_(compute) {}

namespace {

// This thread's adapted model for (model, batch, LoRA config), with the
// global layout it reads: built once, reused by every round and client.
struct LoraWorkspace {
  models::LoraGlobalLayout layout;
  std::unique_ptr<models::LoraLlama> model;
};

Result<LoraWorkspace*> ThreadLoraWorkspace(const std::string& name, int batch, const models::LoraConfig& lora) {
  thread_local std::map<std::string, std::unique_ptr<LoraWorkspace>> workspaces;
  const std::string key = fmt::format("{}/{}/{}/{}/{}/{}", name, batch, lora.rank, lora.alpha, lora.dropout,
                                      fmt::join(lora.target_modules, ","));
  auto& slot = workspaces[key];
  if (!slot) {
    auto built = [&]() -> Result<std::unique_ptr<LoraWorkspace>> {
      ESTUARY_ASSIGN_OR_RETURN(const models::LlamaConfig config, models::LlamaPreset(name));
      auto w = std::make_unique<LoraWorkspace>();
      ESTUARY_ASSIGN_OR_RETURN(w->layout, models::MakeLoraGlobalLayout(config, lora));
      ESTUARY_ASSIGN_OR_RETURN(models::Llama base, models::Llama::Create(config, batch));
      ESTUARY_ASSIGN_OR_RETURN(models::LoraLlama adapted, models::LoraLlama::Create(std::move(base), lora));
      w->model = std::make_unique<models::LoraLlama>(std::move(adapted));
      return w;
    }();
    if (!built.ok()) {
      workspaces.erase(key);
      return built.status();
    }
    slot = std::move(built).value();
  }
  return slot.get();
}

// An exact merge whose average has fewer than r singular values leaves rows
// of A and columns of B zero; there LoRA's gradients vanish for good
// (dA = Bᵀ·…, dB = …·A). Such a row of A is drawn afresh, as PEFT initialises
// A, with B's column left zero: the adapted model does not change.
void ReviveDeadRanks(models::LoraLlama& model, uint64_t seed) {
  const models::Manifest& m = model.manifest();
  std::span<float> p = model.parameters();
  std::mt19937_64 rng(seed);
  for (const models::TensorSpec& a : m.tensors) {
    if (!models::IsLoraA(a.name)) continue;
    const models::TensorSpec* b = m.Find(models::LoraModuleOf(a.name) + ".lora_B.weight");
    const int64_t rank = a.shape[0], in = a.shape[1], out = b->shape[0];
    for (int64_t j = 0; j < rank; ++j) {
      float* row = p.data() + a.offset + j * in;
      bool dead = std::all_of(row, row + in, [](float v) { return v == 0.0f; });
      for (int64_t o = 0; dead && o < out; ++o) dead = p[b->offset + o * rank + j] == 0.0f;
      if (!dead) continue;
      const double bound = 1.0 / std::sqrt(double(in));
      for (int64_t i = 0; i < in; ++i) row[i] = float((2 * (double(rng() >> 11) * 0x1.0p-53) - 1) * bound);
    }
  }
}

// What a site of rank r_i uploads: its model is base + s·B·A (the global
// adapter, rank r, s = alpha/r) + s_i·B_i·A_i (its own, s_i = alpha/r_i), one
// adapter of rank R = r + r_i with scale s' = alpha/R represents both
// exactly: A' = [A; A_i], B' = [(s/s')·B, (s_i/s')·B_i]. An exact merge then
// averages the sites' models as they are, whatever their ranks.
models::Manifest StackedAdapters(const models::Manifest& global_adapter, std::span<const float> global_values,
                                 const models::LoraLlama& site, const models::LoraConfig& federation,
                                 std::vector<float>* payload) {
  const int r = federation.rank, ri = site.lora_config().rank, R = r + ri;
  const double s = double(federation.alpha) / r, si = double(federation.alpha) / ri, sR = double(federation.alpha) / R;
  models::Manifest m;
  payload->clear();
  for (const models::TensorSpec& g : global_adapter.tensors) {
    const models::TensorSpec* own = site.manifest().Find(g.name);
    const float* gv = global_values.data() + g.offset;
    const float* ov = site.parameters().data() + own->offset;
    models::TensorSpec spec{g.name, g.shape, models::DType::kF32, m.total_elements};
    if (models::IsLoraA(g.name)) {  // [r, in] over [r_i, in]: rows stack
      spec.shape = {R, g.shape[1]};
      payload->insert(payload->end(), gv, gv + g.numel());
      payload->insert(payload->end(), ov, ov + own->numel());
    } else {  // [out, r] beside [out, r_i]: columns stack, rescaled
      spec.shape = {g.shape[0], R};
      for (int64_t o = 0; o < g.shape[0]; ++o) {
        for (int j = 0; j < r; ++j) payload->push_back(float(s / sR * gv[o * r + j]));
        for (int j = 0; j < ri; ++j) payload->push_back(float(si / sR * ov[o * ri + j]));
      }
    }
    m.total_elements += spec.numel();
    m.tensors.push_back(std::move(spec));
  }
  return m;
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

Status ValidateLoraTask(const LoraTask& lora) {
  ESTUARY_RETURN_IF_ERROR(lora.config.Validate());
  if (lora.merge != "naive" && lora.merge != "exact" && lora.merge != "frozen-a") {
    return InvalidArgument("task: lora merge '{}' (expected naive, exact or frozen-a)", lora.merge);
  }
  if (lora.mixed_ranks && lora.merge != "exact") {
    return InvalidArgument("task: lora mixed ranks need the exact merge, not {}", lora.merge);
  }
  return Status::Ok();
}

Result<Update> TextTrainer::Train(std::span<const float> global, const models::Manifest& manifest,
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

Result<Update> TextTrainer::TrainLora(std::span<const float> global, const models::Manifest& manifest,
                                      const TaskConfig& task, uint64_t round, std::string_view client_name) {
  ESTUARY_RETURN_IF_ERROR(ValidateLoraTask(task.lora));
  if (compute_.device != models::Device::kCpu) {
    return FailedPrecondition("trainer: update kind lora trains on the CPU only so far; this site runs on {}",
                              compute_.ToString());
  }
  const int seq = static_cast<int>(task.seq_len);
  ESTUARY_ASSIGN_OR_RETURN(LoraWorkspace * w, ThreadLoraWorkspace(task.model, int(task.batch_size), task.lora.config));
  if (!(w->layout.global == manifest) || global.size() != manifest.total_elements) {
    return InvalidArgument("trainer: the global model's manifest is not model '{}' with rank-{} adapters on {}",
                           task.model, task.lora.config.rank, fmt::join(task.lora.config.target_modules, ", "));
  }
  const models::LoraGlobalLayout& layout = w->layout;
  const bool own_rank = lora_rank_ != 0 && lora_rank_ != task.lora.config.rank;
  if (own_rank && !task.lora.mixed_ranks) {
    return FailedPrecondition("trainer: this site trains rank {}, but the federation (rank {}, merge {}) takes its "
                              "own rank only",
                              lora_rank_, task.lora.config.rank, task.lora.merge);
  }
  if (own_rank) {
    // A site of another rank trains its own adapter on the global model
    // with the global adapter folded into its base (below).
    models::LoraConfig site = task.lora.config;
    site.rank = lora_rank_;
    ESTUARY_ASSIGN_OR_RETURN(w, ThreadLoraWorkspace(task.model, int(task.batch_size), site));
  }
  models::LoraLlama& model = *w->model;
  if (seq > model.base().config().max_seq_len) {
    return InvalidArgument("task: seq_len {} exceeds {}'s context of {}", seq, task.model,
                           model.base().config().max_seq_len);
  }
  const auto start = std::chrono::steady_clock::now();
  const uint64_t base_size = layout.base.total_elements;
  std::memcpy(model.base().parameters().data(), global.data(), base_size * sizeof(float));
  const bool frozen_a = task.lora.merge == "frozen-a";
  const uint64_t seed = MixSeed(MixSeed(task.seed, round), client_name);
  if (own_rank) {
    ESTUARY_RETURN_IF_ERROR(models::AddLoraToBase(layout.base, model.base().parameters(), layout.adapter,
                                                  global.subspan(base_size), task.lora.config.alpha));
    model.Initialize(MixSeed(seed, std::string_view("site adapter")));
  } else {
    std::memcpy(model.parameters().data(), global.data() + base_size, model.parameters().size_bytes());
    if (!frozen_a) ReviveDeadRanks(model, MixSeed(seed, std::string_view("revive")));
  }
  model.SeedDropout(MixSeed(seed, std::string_view("dropout")));
  // Under frozen-a A is the federation's and must not move: restored after
  // every step (AdamW's decay would move it even with a zero gradient).
  std::vector<float> frozen;
  if (frozen_a) frozen.assign(model.parameters().begin(), model.parameters().end());
  models::Sgd sgd(task.learning_rate, task.momentum, task.weight_decay);
  models::AdamW adamw(models::AdamWOptions{.lr = task.learning_rate, .weight_decay = task.weight_decay});
  Status status;
  const double loss = RunSchedule(
      task, round, client_name, seq,
      [&](const int32_t* inputs, const int32_t* targets, int n) -> Result<float> {
        ESTUARY_ASSIGN_OR_RETURN(const float l, model.ForwardBackward(inputs, targets, n, seq));
        if (task.optimizer == OptimizerKind::kAdamW) {
          adamw.Step(model.parameters(), model.gradients());
        } else {
          sgd.Step(model.parameters(), model.gradients());
        }
        if (frozen_a) {
          for (const models::TensorSpec& spec : model.manifest().tensors) {
            if (!models::IsLoraA(spec.name)) continue;
            std::memcpy(model.parameters().data() + spec.offset, frozen.data() + spec.offset,
                        spec.numel() * sizeof(float));
          }
        }
        return l;
      },
      &status);
  ESTUARY_RETURN_IF_ERROR(status);
  if (!std::isfinite(loss)) {
    return FailedPrecondition("trainer: local training diverged (loss {}) in round {}", loss, round);
  }
  Update update;
  update.kind = UpdateKind::kLora;
  update.num_examples = num_examples();
  update.train_loss = loss;
  if (own_rank) {
    update.manifest = StackedAdapters(layout.adapter, global.subspan(base_size), model, task.lora.config,
                                      &update.payload);
    update.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return update;
  }
  update.manifest = models::LoraUploadManifest(model.manifest(), frozen_a);
  update.payload.reserve(update.manifest.total_elements);
  for (const models::TensorSpec& spec : update.manifest.tensors) {
    const models::TensorSpec* at = model.manifest().Find(spec.name);
    update.payload.insert(update.payload.end(), model.parameters().begin() + at->offset,
                          model.parameters().begin() + at->offset + at->numel());
  }
  update.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return update;
}

}  // namespace estuary::client
