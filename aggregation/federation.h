// Federation: what a v1::FederationConfig (proto/federation.proto) defines,
// built once for whoever runs it. The server and the simulator both call
// MakeFederation, so both start from the same initial model, merge with the
// same strategy and score with the same evaluator.
//
// A federation of update kind full starts from the task's model initialised
// from the seed, or from a Hugging Face base (base_model a model directory)
// itself, and merges weight deltas with the configured strategy (FedAvg,
// FedAdam). One of kind lora starts from the base (the preset from
// the seed, or base_model's safetensors) followed by the global adapter
// (models/lora_federation.h) and merges the sites' adapters by the task's
// LoRA merge rule (lora_strategy.h).
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <vector>

#include "aggregation/dp_fedavg.h"
#include "aggregation/lora_strategy.h"
#include "aggregation/strategy.h"
#include "aggregation/update_bound.h"
#include "base/manifest.h"
#include "base/status.h"
#include "federation.pb.h"
#include "models/hf_base.h"
#include "models/llama.h"
#include "models/custom_model.h"
#include "models/federated_model.h"

namespace estuary::aggregation {

// The defaults every front end starts from: McMahan et al.'s 2NN on MNIST
// (mlp, 5 epochs of batch 10 at lr 0.05), FedAvg, seed 2017.
v1::FederationConfig DefaultFederation();

// Checks every field, each error one line naming its key as the flags and
// config files spell it: "federation: epochs = 0: must be in [1, 1000]".
Status CheckFederation(const v1::FederationConfig& config);

// The DP-FedAvg options of config.dp (without a seed).
DpOptions DpOptionsOf(const v1::DpConfig& dp);

// The strategy options of a federation of update kind full.
StrategyOptions StrategyOptionsOf(const v1::StrategyConfig& config);

// The task's adapters as the models name them (not checked: LoraOptionsOf
// checks them).
models::LoraConfig LoraConfigOf(const v1::TaskConfig& task);

// A federation of update kind lora: the global layout, the merge rule, rank
// and alpha, mixed ranks; of the task's model by name (a preset or a
// registered Hugging Face base), or of `model`.
Result<LoraStrategyOptions> LoraOptionsOf(const v1::TaskConfig& task);
Result<LoraStrategyOptions> LoraOptionsOf(const v1::TaskConfig& task, const models::LlamaConfig& model);

// A federation file: a v1::FederationConfig in protobuf text format, its
// fields over DefaultFederation's (a field left out keeps its default; a
// target_modules list given replaces the default one). Errors name the file
// and, for syntax, the line and column.
Result<v1::FederationConfig> ReadFederationFile(const std::filesystem::path& path);
// Writes the whole config in text format, atomically.
Status WriteFederationFile(const std::filesystem::path& path, const v1::FederationConfig& config);

struct Federation {
  v1::FederationConfig config;  // as checked
  Manifest manifest;            // the global model's layout
  std::vector<float> initial;   // the global model before round 1
  std::unique_ptr<Strategy> strategy;
  UpdateBound bound{v1::UpdateLimits()};         // what each update is folded as (config.limits)
  std::unique_ptr<models::Evaluator> evaluator;  // null without evaluation data
  std::optional<LoraStrategyOptions> lora;       // set in a federation of update kind lora
  // A federation on a Hugging Face base (base_model a model directory,
  // models/hf_base.h): what every site holds before round 1, the global
  // layout with the base's weights (and, in a lora federation, a zero
  // adapter after them). The server sends a
  // site only what differs from it (RoundStart.patch_on_base), never the
  // base. config.task() then names the base and carries its shape and
  // identity (hf_base). Null otherwise.
  std::shared_ptr<const std::vector<float>> held_base;
  // A federation of a model known only as a file (config.initial_model,
  // models/custom_model.h): its layout and held tensors, for the
  // checkpoints. config.task().model() is then its name, "custom@...", and
  // there is no evaluator: the server knows no architecture to score.
  // Null otherwise.
  std::shared_ptr<const models::CustomModel> custom;
};

struct EvaluationOptions {
  // An IDX directory, a fortunes directory for text, or a JSON Lines file of
  // held-out instruction examples (rendered with the task's template and
  // scored on their response targets); empty: no evaluator.
  std::filesystem::path data;
  // A JSON Lines `data`'s tokenizer.json; empty: the Hugging Face base's own.
  std::filesystem::path tokenizer;
  int threads = 2;
  // Language models on instruction data: held-out rows scored on their
  // response targets (models::MakeRowsEvaluator) instead of `data`.
  std::shared_ptr<const models::TokenRows> rows;
};

// Where DP noise comes from when config.dp is on: a server's is unpredictable
// (keyed from RAND_bytes), a simulation's seeded from the task's seed so the
// run reproduces (dp_noise.h).
enum class DpNoise { kUnpredictable, kSeeded };

// When config->base_model is a Hugging Face model directory: loads it,
// names the task's model after it (HfBase::ModelName), sets task.hf_base
// (shape and identity) and registers the name (models::RegisterHfModel), so
// the task is what the sites are sent; returns the base. Otherwise changes
// nothing and returns null. MakeFederation calls it; a front end that needs
// the task before the federation (the simulator's clients) calls it first.
Result<std::shared_ptr<const models::HfBase>> ApplyHfBase(v1::FederationConfig* config);

// When config->initial_model is set: loads the file, names the task's model
// after its layout ("custom@<12 hex>", models/custom_model.h) and returns
// it; errors name the file and what is wrong in one line. Otherwise changes
// nothing and returns null. MakeFederation calls it.
Result<std::shared_ptr<const models::CustomModel>> ApplyInitialModel(v1::FederationConfig* config);

// With config.dp.noise_multiplier > 0 the strategy is DpFedAvg around the
// configured one. With config.initial_model, evaluation.data must be empty:
// the server has no evaluator for a model it knows only as tensors.
Result<Federation> MakeFederation(const v1::FederationConfig& config, const EvaluationOptions& evaluation,
                                  DpNoise noise = DpNoise::kUnpredictable);

}  // namespace estuary::aggregation
