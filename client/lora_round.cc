#include "client/lora_round.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "base/seed.h"
#include "models/language_model.h"
#include "models/llama.h"

namespace estuary::client {

namespace {

// An exact merge whose average has fewer than r singular values leaves rows
// of A and columns of B zero; there LoRA's gradients vanish for good
// (dA = Bᵀ·…, dB = …·A). Such a row of A is drawn afresh, as PEFT initialises
// A, with B's column left zero: the adapted model does not change.
void ReviveDeadRanks(const Manifest& m, std::span<float> p, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (const TensorSpec& a : m.tensors) {
    if (!models::IsLoraA(a.name)) continue;
    const TensorSpec* b = m.Find(models::LoraModuleOf(a.name) + ".lora_B.weight");
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
Manifest StackedAdapters(const Manifest& global_adapter, std::span<const float> global_values,
                                 const Manifest& site_adapter, std::span<const float> site_values,
                                 const models::LoraConfig& federation, int site_rank, std::vector<float>* payload) {
  const int r = federation.rank, ri = site_rank, R = r + ri;
  const double s = double(federation.alpha) / r, si = double(federation.alpha) / ri, sR = double(federation.alpha) / R;
  Manifest m;
  payload->clear();
  for (const TensorSpec& g : global_adapter.tensors) {
    const TensorSpec* own = site_adapter.Find(g.name);
    const float* gv = global_values.data() + g.offset;
    const float* ov = site_values.data() + own->offset;
    TensorSpec spec{g.name, g.shape, DType::kF32, m.total_elements};
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

std::string LoraConfigKey(const models::LoraConfig& lora) {
  return fmt::format("{}/{}/{}/{}", lora.rank, lora.alpha, lora.dropout, fmt::join(lora.target_modules, ","));
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

Result<LoraRound> PlanLoraRound(const TaskConfig& task, int site_rank) {
  ESTUARY_RETURN_IF_ERROR(ValidateLoraTask(task.lora));
  ESTUARY_ASSIGN_OR_RETURN(const models::LlamaConfig config, models::LlamaPreset(task.model));
  LoraRound plan;
  ESTUARY_ASSIGN_OR_RETURN(plan.layout, models::MakeLoraGlobalLayout(config, task.lora.config));
  plan.own_rank = site_rank != 0 && site_rank != task.lora.config.rank;
  if (plan.own_rank && !task.lora.mixed_ranks) {
    return FailedPrecondition("trainer: this site trains rank {}, but the federation (rank {}, merge {}) takes its "
                              "own rank only",
                              site_rank, task.lora.config.rank, task.lora.merge);
  }
  if (int(task.seq_len) > config.max_seq_len) {
    return InvalidArgument("task: seq_len {} exceeds {}'s context of {}", task.seq_len, task.model,
                           config.max_seq_len);
  }
  plan.federation = task.lora.config;
  plan.site = task.lora.config;
  if (plan.own_rank) plan.site.rank = site_rank;
  plan.site_layout = models::LoraLayoutOf(config, plan.site);
  plan.frozen_a = task.lora.merge == "frozen-a";
  return plan;
}

Status CheckLoraGlobal(const LoraRound& plan, const TaskConfig& task, const Manifest& manifest,
                       size_t global_size) {
  if (!(plan.layout.global == manifest) || global_size != manifest.total_elements) {
    return InvalidArgument("trainer: the global model's manifest is not model '{}' with rank-{} adapters on {}",
                           task.model, task.lora.config.rank, fmt::join(task.lora.config.target_modules, ", "));
  }
  return Status::Ok();
}

Result<LoraStart> StartLoraRound(const LoraRound& plan, std::span<const float> global, const TaskConfig& task,
                                 uint64_t round, std::string_view client_name) {
  if (global.size() != plan.layout.global.total_elements) {
    return InvalidArgument("trainer: {} global values for model '{}' with its adapters, of {}", global.size(),
                           task.model, plan.layout.global.total_elements);
  }
  const uint64_t base_size = plan.layout.base.total_elements;
  const uint64_t seed = MixSeed(MixSeed(task.seed, round), client_name);
  LoraStart start;
  start.global_base = global.first(base_size);
  start.dropout_seed = MixSeed(seed, std::string_view("dropout"));
  if (plan.own_rank) {
    // A site of another rank trains its own adapter on the global model,
    // with the global adapter folded into its base.
    start.folded_base.assign(start.global_base.begin(), start.global_base.end());
    ESTUARY_RETURN_IF_ERROR(models::AddLoraToBase(plan.layout.base, start.folded_base, plan.layout.adapter,
                                                  global.subspan(base_size), plan.federation.alpha));
    start.adapter.resize(plan.site_layout.manifest.total_elements);
    models::InitializeLoraAdapters(plan.site_layout, MixSeed(seed, std::string_view("site adapter")), start.adapter);
    return start;
  }
  start.adapter.assign(global.begin() + base_size, global.end());
  if (!plan.frozen_a) ReviveDeadRanks(plan.layout.adapter, start.adapter, MixSeed(seed, std::string_view("revive")));
  return start;
}

Result<Update> LoraUpdateOf(const LoraRound& plan, std::span<const float> global, std::span<const float> trained,
                            uint64_t num_examples, double train_loss, std::chrono::steady_clock::time_point start,
                            uint64_t round) {
  ESTUARY_ASSIGN_OR_RETURN(Update update, TrainedUpdate(UpdateKind::kLora, num_examples, train_loss, round));
  const uint64_t base_size = plan.layout.base.total_elements;
  if (plan.own_rank) {
    update.manifest = StackedAdapters(plan.layout.adapter, global.subspan(base_size), plan.site_layout.manifest,
                                      trained, plan.federation, plan.site.rank, &update.payload);
  } else {
    update.manifest = models::LoraUploadManifest(plan.layout.adapter, plan.frozen_a);
    update.payload.reserve(update.manifest.total_elements);
    for (const TensorSpec& spec : update.manifest.tensors) {
      const TensorSpec* at = plan.layout.adapter.Find(spec.name);
      update.payload.insert(update.payload.end(), trained.begin() + at->offset,
                            trained.begin() + at->offset + at->numel());
    }
  }
  update.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return update;
}

void FrozenA::Start(const TaskConfig& task, std::span<const float> adapter) {
  kept_.clear();
  if (task.lora.merge == "frozen-a") kept_.assign(adapter.begin(), adapter.end());
}

Status FrozenA::Restore(const Manifest& manifest,
                        const std::function<Status(uint64_t, std::span<const float>)>& put) const {
  for (const TensorSpec& spec : manifest.tensors) {
    if (!active() || !models::IsLoraA(spec.name)) continue;
    ESTUARY_RETURN_IF_ERROR(put(spec.offset, std::span<const float>(kept_).subspan(spec.offset, spec.numel())));
  }
  return Status::Ok();
}

}  // namespace estuary::client
