// The model of a federation whose update kind is `lora`, laid out the same way
// by the server, the in-process simulator and every site.
//
// The global buffer is the frozen base decoder's tensors (LlamaLayout, Hugging
// Face names) followed by the global adapter (LoraLlama::manifest(), PEFT
// names: "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight").
// The model a site trains from, and the one the server evaluates, is
//   W = base + (alpha / r) · B · A   for every adapted projection.
// A site uploads only its adapter factors (LoraUploadManifest): all of them,
// or under frozen-a only the B factors, since A is fixed and shared.
// One flat buffer for both parts keeps the wire, staging, checksums and
// checkpoints exactly as they are for full models.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "base/status.h"
#include "models/federated_model.h"
#include "models/llama.h"
#include "models/lora.h"
#include "models/tensor.h"

namespace estuary::models {

struct LoraGlobalLayout {
  Manifest global;   // base tensors, then adapter tensors
  Manifest base;     // LlamaLayout's manifest: global's first base.total_elements
  Manifest adapter;  // the adapter as LoraLlama lays it out, offsets from 0
  uint64_t adapter_offset() const { return base.total_elements; }
};

// Fails on an invalid LoRA config.
Result<LoraGlobalLayout> MakeLoraGlobalLayout(const LlamaConfig& config, const LoraConfig& lora);

// What a site uploads: the adapter manifest, or with b_only (frozen-a) its
// lora_B tensors alone, packed from offset 0 in the same order.
Manifest LoraUploadManifest(const Manifest& adapter, bool b_only);

// "base_model.model.model.layers.0.self_attn.q_proj" for that module's
// "...q_proj.lora_A.weight" or "...lora_B.weight"; empty for any other name.
std::string LoraModuleOf(std::string_view tensor_name);
// True for a "...lora_A.weight" name, false for "...lora_B.weight".
bool IsLoraA(std::string_view tensor_name);

// base[W] += (alpha / r) · B · A for every module of `adapter` (r from the
// shapes, so adapters of any rank), W being the base tensor the module names
// ("model.layers.0.self_attn.q_proj.weight"). Fails, naming the tensor, when
// a module's base weight is missing or the shapes disagree. With b_only
// adapters (no A), nothing can be added: InvalidArgument.
Status AddLoraToBase(const Manifest& base_manifest, std::span<float> base, const Manifest& adapter,
                     std::span<const float> adapter_values, float alpha);

// The initial global model of a LoRA federation over preset `model`: the
// base from `base_checkpoint` (a safetensors file with the preset's tensors
// by Hugging Face name, in any order) or, when that is empty, the preset
// initialised from `seed`; then the adapter as LoraLlama::Initialize(seed)
// makes it (B = 0, so the adapted model equals the base).
Result<InitialWeights> LoraInitialModel(std::string_view model, const LoraConfig& lora, uint64_t seed,
                                        const std::filesystem::path& base_checkpoint);

// The same over a base given as its config and weights (a Hugging Face
// base, models/hf_base.h), in LayoutOf(config) order.
Result<InitialWeights> LoraInitialModel(const LlamaConfig& config, const LoraConfig& lora, uint64_t seed,
                                        std::span<const float> base_weights);

// Reads a base decoder's weights for `config` from a safetensors file: every
// tensor of LayoutOf(config) by name and shape (extra tensors are an error,
// so a wrong file is not half-used). Errors name the file and the tensor.
Result<std::vector<float>> LoadBaseWeights(const std::filesystem::path& path, const LlamaConfig& config);

// An evaluator of the global buffer of a LoRA federation: it forms
// base + (alpha/r)·B·A and hands that to `inner` (an evaluator of the base
// preset, MakeEvaluator).
std::unique_ptr<Evaluator> MakeLoraEvaluator(std::unique_ptr<Evaluator> inner, LoraGlobalLayout layout, float alpha);

}  // namespace estuary::models
