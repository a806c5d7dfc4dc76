#include "aggregation/lora_strategy.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace estuary::aggregation {

namespace {

// "lora_A" or "lora_B": the field of the module a tensor is.
std::string_view Factor(std::string_view name) { return models::IsLoraA(name) ? "lora_A" : "lora_B"; }

}  // namespace

Manifest ExpectedLoraUpload(const LoraStrategyOptions& options) {
  return models::LoraUploadManifest(options.layout.adapter, options.merge.rule == LoraMergeRule::kFrozenA);
}

Status ValidateLoraStrategyOptions(const LoraStrategyOptions& options) {
  if (options.mixed_ranks && options.merge.rule != LoraMergeRule::kExact) {
    return InvalidArgument("lora: mixed ranks need the exact merge; {} averages factors of equal rank only",
                           LoraMergeRuleName(options.merge.rule));
  }
  if (options.merge.rank == 0 || !(options.merge.alpha > 0)) {
    return InvalidArgument("lora: rank {} and alpha {} must be positive", options.merge.rank, options.merge.alpha);
  }
  for (const auto& spec : options.layout.adapter.tensors) {
    const int64_t rank = models::IsLoraA(spec.name) ? spec.shape.at(0) : spec.shape.at(1);
    if (uint64_t(rank) != options.merge.rank) {
      return InvalidArgument("lora: the global adapter's {} has rank {}, the federation's is {}", spec.name, rank,
                             options.merge.rank);
    }
  }
  if (options.layout.adapter.tensors.empty()) return InvalidArgument("lora: the global adapter has no tensors");
  return Status::Ok();
}

Status CheckLoraUpload(std::string_view client, const Manifest& upload, const LoraStrategyOptions& options) {
  const Manifest expected = ExpectedLoraUpload(options);
  const uint64_t rank = options.merge.rank;
  std::map<std::string, int64_t> a_rank;  // module -> the rank its A declared
  for (size_t i = 0; i < upload.tensors.size(); ++i) {
    const TensorSpec& got = upload.tensors[i];
    const TensorSpec* want = expected.Find(got.name);
    const std::string module = models::LoraModuleOf(got.name);
    if (want == nullptr) {
      if (module.empty()) {
        return InvalidArgument("lora update from {}: tensor {}: not a LoRA factor (the upload holds adapters only)",
                               client, got.name);
      }
      if (options.merge.rule == LoraMergeRule::kFrozenA && models::IsLoraA(got.name) &&
          options.layout.adapter.Find(got.name) != nullptr) {
        return InvalidArgument("lora update from {}: module {}: lora_A is not in the federation's B-only (frozen-a) "
                               "upload",
                               client, module);
      }
      return InvalidArgument("lora update from {}: module {}: {} is not among the federation's target modules", client,
                             module, Factor(got.name));
    }
    if (i >= expected.tensors.size() || expected.tensors[i].name != got.name) {
      return InvalidArgument("lora update from {}: module {}: {} is tensor {} of the upload, the federation's layout "
                             "has it at {}",
                             client, module, Factor(got.name), i, want - expected.tensors.data());
    }
    if (got.dtype != DType::kF32) {
      return InvalidArgument("lora update from {}: module {}: {} dtype {}, the federation's is f32", client, module,
                             Factor(got.name), DTypeName(got.dtype));
    }
    if (got.shape.size() != 2) {
      return InvalidArgument("lora update from {}: module {}: {} has {} dimensions, expected 2", client, module,
                             Factor(got.name), got.shape.size());
    }
    const bool is_a = models::IsLoraA(got.name);
    // A is [rank, in], B is [out, rank].
    const int64_t got_rank = is_a ? got.shape[0] : got.shape[1];
    const int64_t got_dim = is_a ? got.shape[1] : got.shape[0];
    const int64_t want_dim = is_a ? want->shape[1] : want->shape[0];
    if (got_dim != want_dim) {
      return InvalidArgument("lora update from {}: module {}: {} {} {}, the federation's is {}", client, module,
                             Factor(got.name), is_a ? "in_features" : "out_features", got_dim, want_dim);
    }
    if (got_rank <= 0 || (!options.mixed_ranks && uint64_t(got_rank) != rank)) {
      return InvalidArgument("lora update from {}: module {}: {} rank {}, the federation's is {}{}", client, module,
                             Factor(got.name), got_rank, rank,
                             options.merge.rule == LoraMergeRule::kExact ? "" : " (only exact merges mixed ranks)");
    }
    if (is_a) {
      a_rank[module] = got_rank;
    } else if (auto it = a_rank.find(module); it != a_rank.end() && it->second != got_rank) {
      return InvalidArgument("lora update from {}: module {}: lora_B rank {}, its lora_A has rank {}", client, module,
                             got_rank, it->second);
    }
  }
  if (upload.tensors.size() < expected.tensors.size()) {
    const auto& missing = expected.tensors[upload.tensors.size()];
    return InvalidArgument("lora update from {}: module {}: {} missing ({} of {} tensors sent)", client,
                           models::LoraModuleOf(missing.name), Factor(missing.name), upload.tensors.size(),
                           expected.tensors.size());
  }
  return Status::Ok();
}

LoraStrategy::LoraStrategy(LoraStrategyOptions options)
    : options_(std::move(options)),
      expected_(ExpectedLoraUpload(options_)),
      name_(fmt::format("lora-{}", LoraMergeRuleName(options_.merge.rule))) {}

Result<std::unique_ptr<Strategy>> LoraStrategy::Make(LoraStrategyOptions options) {
  ESTUARY_RETURN_IF_ERROR(ValidateLoraStrategyOptions(options));
  return std::unique_ptr<Strategy>(std::make_unique<LoraStrategy>(std::move(options)));
}

Status LoraStrategy::Begin(uint64_t round, std::span<const float> global) {
  if (global.size() != options_.layout.global.total_elements) {
    return InvalidArgument("lora strategy: round {}: a global model of {} values, the LoRA layout has {}", round,
                           global.size(), options_.layout.global.total_elements);
  }
  global_adapter_.assign(global.begin() + options_.layout.adapter_offset(), global.end());
  updates_.clear();
  weights_.clear();
  return Status::Ok();
}

Status LoraStrategy::Fold(std::span<const float> values, double weight) {
  return FoldUpdate(fmt::format("client {}", updates_.size()), expected_, values, weight);
}

Status LoraStrategy::FoldUpdate(std::string_view client, const Manifest& layout, std::span<const float> values,
                                double weight) {
  ESTUARY_RETURN_IF_ERROR(CheckLoraUpload(client, layout, options_));
  if (values.size() != layout.total_elements) {
    return InvalidArgument("lora update from {}: {} values, its manifest has {}", client, values.size(),
                           layout.total_elements);
  }
  if (!(weight > 0) || !std::isfinite(weight)) {
    return InvalidArgument("lora update from {}: weight {} must be finite and > 0", client, weight);
  }
  const bool frozen_a = options_.merge.rule == LoraMergeRule::kFrozenA;
  // Every merged value is a weighted mean of (alpha/r)·Σ_k b·a over r terms,
  // so factors within ±largest keep it under FLT_MAX / 4: a merge that
  // could overflow is refused here, at its own update, not at Finish.
  const double largest = std::sqrt(double(std::numeric_limits<float>::max()) / 4 /
                                   std::max(1.0, double(options_.merge.alpha)));
  LoraUpdate update;
  for (const TensorSpec& spec : layout.tensors) {
    const float* v = values.data() + spec.offset;
    for (uint64_t i = 0; i < spec.numel(); ++i) {
      if (!std::isfinite(v[i]) || std::abs(v[i]) > largest) {
        return InvalidArgument("lora update from {}: module {}: {} element {} is {}{}", client,
                               models::LoraModuleOf(spec.name), Factor(spec.name), i, v[i],
                               std::isfinite(v[i]) ? fmt::format(", beyond {:.3g}: the merge would overflow float",
                                                                 largest)
                                                   : "");
      }
    }
    LoraAdapter& adapter = update.modules[models::LoraModuleOf(spec.name)];
    adapter.alpha = options_.merge.alpha;
    if (models::IsLoraA(spec.name)) {
      adapter.rank = size_t(spec.shape[0]), adapter.in = size_t(spec.shape[1]);
      adapter.a.assign(v, v + spec.numel());
    } else {
      adapter.out = size_t(spec.shape[0]), adapter.rank = size_t(spec.shape[1]);
      adapter.b.assign(v, v + spec.numel());
    }
  }
  if (frozen_a) {
    // A is the federation's, fixed: take it from the global adapter.
    for (const TensorSpec& spec : options_.layout.adapter.tensors) {
      if (!models::IsLoraA(spec.name)) continue;
      LoraAdapter& adapter = update.modules.at(models::LoraModuleOf(spec.name));
      adapter.in = size_t(spec.shape[1]);
      adapter.a.assign(global_adapter_.begin() + spec.offset, global_adapter_.begin() + spec.offset + spec.numel());
    }
  }
  updates_.push_back(std::move(update));
  weights_.push_back(weight);
  return Status::Ok();
}

Status LoraStrategy::Finish(std::span<float> global) {
  if (updates_.empty()) return FailedPrecondition("lora strategy: nothing folded");
  if (global.size() != options_.layout.global.total_elements) {
    return InvalidArgument("lora strategy: {} values to finish, the LoRA layout has {}", global.size(),
                           options_.layout.global.total_elements);
  }
  ESTUARY_ASSIGN_OR_RETURN(LoraMergeResult merged, MergeLoraUpdates(updates_, weights_, options_.merge));
  const models::LoraGlobalLayout& layout = options_.layout;
  std::span<float> base = global.first(layout.base.total_elements);
  std::span<float> adapter = global.subspan(layout.adapter_offset());
  for (const TensorSpec& spec : layout.adapter.tensors) {
    const std::string module = models::LoraModuleOf(spec.name);
    auto it = merged.modules.find(module);
    if (it == merged.modules.end()) return Internal("lora strategy: the merge has no module {}", module);
    const std::vector<float>& source = models::IsLoraA(spec.name) ? it->second.adapter.a : it->second.adapter.b;
    if (source.size() != spec.numel()) {
      return Internal("lora strategy: merged {} has {} values, the layout {}", spec.name, source.size(), spec.numel());
    }
    std::memcpy(adapter.data() + spec.offset, source.data(), source.size() * sizeof(float));
  }
  low_rank_changes_.clear();
  for (auto& [module, m] : merged.modules) {
    if (m.residual.empty()) continue;
    // "base_model.model." + "model.layers.0.self_attn.q_proj" -> its base weight.
    const std::string weight = module.substr(std::string_view("base_model.model.").size()) + ".weight";
    const TensorSpec* w = layout.base.Find(weight);
    if (w == nullptr || w->numel() != m.residual.rows * m.residual.cols) {
      return Internal("lora strategy: residual of {} does not fit base tensor {}", module, weight);
    }
    m.residual.AddTo(base.subspan(w->offset, w->numel()));
    if (m.residual.factor_bytes() < m.residual.dense_bytes()) {
      low_rank_changes_.push_back({w->offset, std::move(m.residual)});  // the base is the global's first part
    }
  }
  // In the buffer's order (the merge's is by module name), as a patch lists them.
  std::sort(low_rank_changes_.begin(), low_rank_changes_.end(),
            [](const LowRankChange& a, const LowRankChange& b) { return a.offset < b.offset; });
  adapter_bytes_ = merged.adapter_bytes;
  residual_bytes_ = merged.residual_bytes;
  changed_bytes_ = adapter_bytes_ + residual_bytes_;
  updates_.clear();
  weights_.clear();
  return Status::Ok();
}

}  // namespace estuary::aggregation
