#include "models/lora_federation.h"

#include <cblas.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "models/checkpoint.h"
#include "models/language_model.h"

namespace estuary::models {

namespace {

constexpr std::string_view kPeftPrefix = "base_model.model.";
constexpr std::string_view kA = ".lora_A.weight";
constexpr std::string_view kB = ".lora_B.weight";

class LoraEvaluator : public Evaluator {
 public:
  LoraEvaluator(std::unique_ptr<Evaluator> inner, LoraGlobalLayout layout, float alpha)
      : inner_(std::move(inner)), layout_(std::move(layout)), alpha_(alpha) {}

  Result<EvalResult> Evaluate(std::span<const float> global) override {
    if (global.size() != layout_.global.total_elements) {
      return InvalidArgument("lora evaluator: {} values for a global model of {}", global.size(),
                             layout_.global.total_elements);
    }
    merged_.assign(global.begin(), global.begin() + layout_.base.total_elements);
    ESTUARY_RETURN_IF_ERROR(AddLoraToBase(layout_.base, merged_, layout_.adapter,
                                          global.subspan(layout_.adapter_offset()), alpha_));
    return inner_->Evaluate(merged_);
  }

 private:
  std::unique_ptr<Evaluator> inner_;
  LoraGlobalLayout layout_;
  float alpha_;
  std::vector<float> merged_;  // reused: the evaluator runs once per round
};

}  // namespace

std::string LoraModuleOf(std::string_view name) {
  for (std::string_view suffix : {kA, kB}) {
    if (name.size() > suffix.size() && name.ends_with(suffix)) {
      return std::string(name.substr(0, name.size() - suffix.size()));
    }
  }
  return {};
}

bool IsLoraA(std::string_view name) { return name.ends_with(kA); }

Result<LoraGlobalLayout> MakeLoraGlobalLayout(const LlamaConfig& config, const LoraConfig& lora) {
  ESTUARY_RETURN_IF_ERROR(config.Validate());
  ESTUARY_RETURN_IF_ERROR(lora.Validate());
  LoraGlobalLayout layout;
  layout.base = LayoutOf(config).manifest;
  // The adapter's names and shapes are LoraLlama's own: build one on a
  // one-sequence arena (mapped lazily, so this touches little memory).
  ESTUARY_ASSIGN_OR_RETURN(Llama base, Llama::Create(config, 1));
  ESTUARY_ASSIGN_OR_RETURN(LoraLlama adapted, LoraLlama::Create(std::move(base), lora));
  layout.adapter = adapted.manifest();
  layout.global = layout.base;
  for (TensorSpec spec : layout.adapter.tensors) {
    spec.offset += layout.base.total_elements;
    layout.global.tensors.push_back(std::move(spec));
  }
  layout.global.total_elements = layout.base.total_elements + layout.adapter.total_elements;
  return layout;
}

Manifest LoraUploadManifest(const Manifest& adapter, bool b_only) {
  if (!b_only) return adapter;
  Manifest upload;
  for (TensorSpec spec : adapter.tensors) {
    if (IsLoraA(spec.name)) continue;
    spec.offset = upload.total_elements;
    upload.total_elements += spec.numel();
    upload.tensors.push_back(std::move(spec));
  }
  return upload;
}

Status AddLoraToBase(const Manifest& base_manifest, std::span<float> base, const Manifest& adapter,
                     std::span<const float> adapter_values, float alpha) {
  if (base.size() != base_manifest.total_elements || adapter_values.size() != adapter.total_elements) {
    return InvalidArgument("lora: {} base and {} adapter values for manifests of {} and {}", base.size(),
                           adapter_values.size(), base_manifest.total_elements, adapter.total_elements);
  }
  for (const TensorSpec& a : adapter.tensors) {
    if (!IsLoraA(a.name)) continue;
    const std::string module = LoraModuleOf(a.name);
    const TensorSpec* b = adapter.Find(fmt::format("{}{}", module, kB));
    if (!module.starts_with(kPeftPrefix) || b == nullptr) {
      return InvalidArgument("lora: adapter tensor {} has no lora_B beside it", a.name);
    }
    const std::string weight = module.substr(kPeftPrefix.size()) + ".weight";
    const TensorSpec* w = base_manifest.Find(weight);
    if (w == nullptr) return InvalidArgument("lora: adapter module {} adapts {}, which the base has not", module, weight);
    if (a.shape.size() != 2 || b->shape.size() != 2 || w->shape.size() != 2 || a.shape[0] != b->shape[1] ||
        a.shape[1] != w->shape[1] || b->shape[0] != w->shape[0] || a.shape[0] <= 0) {
      return InvalidArgument("lora: module {}: A [{}], B [{}] do not factor {} [{}]", module, fmt::join(a.shape, ", "),
                             fmt::join(b->shape, ", "), weight, fmt::join(w->shape, ", "));
    }
    const int rank = int(a.shape[0]), in = int(a.shape[1]), out = int(b->shape[0]);
    const float scale = float(double(alpha) / double(rank));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, out, in, rank, scale, adapter_values.data() + b->offset,
                rank, adapter_values.data() + a.offset, in, 1.0f, base.data() + w->offset, in);
  }
  for (const TensorSpec& t : adapter.tensors) {
    if (!IsLoraA(t.name) && adapter.Find(fmt::format("{}{}", LoraModuleOf(t.name), kA)) == nullptr) {
      return InvalidArgument("lora: adapter tensor {} has no lora_A beside it (a B-only upload cannot be applied)",
                             t.name);
    }
  }
  return Status::Ok();
}

Result<std::vector<float>> LoadBaseWeights(const std::filesystem::path& path, const LlamaConfig& config) {
  ESTUARY_ASSIGN_OR_RETURN(Checkpoint file, LoadCheckpoint(path));
  const Manifest layout = LayoutOf(config).manifest;
  std::vector<float> values(layout.total_elements);
  for (const TensorSpec& spec : layout.tensors) {
    const TensorSpec* found = file.manifest.Find(spec.name);
    if (found == nullptr) return InvalidArgument("base model {}: tensor {} missing", path.string(), spec.name);
    if (found->shape != spec.shape || found->dtype != DType::kF32) {
      return InvalidArgument("base model {}: tensor {} is {} [{}], the model wants f32 [{}]", path.string(), spec.name,
                             DTypeName(found->dtype), fmt::join(found->shape, ", "), fmt::join(spec.shape, ", "));
    }
    std::memcpy(values.data() + spec.offset, file.data.data() + found->offset, spec.numel() * sizeof(float));
  }
  for (const TensorSpec& spec : file.manifest.tensors) {
    if (layout.Find(spec.name) == nullptr) {
      return InvalidArgument("base model {}: tensor {} is not one of the model's {}", path.string(), spec.name,
                             layout.tensors.size());
    }
  }
  return values;
}

Result<InitialWeights> LoraInitialModel(std::string_view model, const LoraConfig& lora, uint64_t seed,
                                        const std::filesystem::path& base_checkpoint) {
  ESTUARY_ASSIGN_OR_RETURN(const LlamaConfig config, LlamaPreset(model));
  ESTUARY_RETURN_IF_ERROR(lora.Validate());
  std::vector<float> weights;
  if (base_checkpoint.empty()) {
    ESTUARY_ASSIGN_OR_RETURN(Llama base, Llama::Create(config, 1));
    base.Initialize(seed);
    weights.assign(base.parameters().begin(), base.parameters().end());
  } else {
    ESTUARY_ASSIGN_OR_RETURN(weights, LoadBaseWeights(base_checkpoint, config));
  }
  return LoraInitialModel(config, lora, seed, weights);
}

Result<InitialWeights> LoraInitialModel(const LlamaConfig& config, const LoraConfig& lora, uint64_t seed,
                                        std::span<const float> base_weights) {
  ESTUARY_RETURN_IF_ERROR(lora.Validate());
  ESTUARY_ASSIGN_OR_RETURN(Llama base, Llama::Create(config, 1));
  if (base_weights.size() != base.parameters().size()) {
    return InvalidArgument("base model: {} weights, the config's decoder has {}", base_weights.size(),
                           base.parameters().size());
  }
  std::copy(base_weights.begin(), base_weights.end(), base.parameters().begin());
  ESTUARY_ASSIGN_OR_RETURN(LoraGlobalLayout layout, MakeLoraGlobalLayout(config, lora));
  InitialWeights initial;
  initial.manifest = layout.global;
  initial.values.assign(base.parameters().begin(), base.parameters().end());
  ESTUARY_ASSIGN_OR_RETURN(LoraLlama adapted, LoraLlama::Create(std::move(base), lora));
  adapted.Initialize(seed);
  initial.values.insert(initial.values.end(), adapted.parameters().begin(), adapted.parameters().end());
  return initial;
}

std::unique_ptr<Evaluator> MakeLoraEvaluator(std::unique_ptr<Evaluator> inner, LoraGlobalLayout layout, float alpha) {
  return std::make_unique<LoraEvaluator>(std::move(inner), std::move(layout), alpha);
}

}  // namespace estuary::models
