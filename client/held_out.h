// HeldOut: a built-in site's held-out examples, and the trainer that scores a
// global model on them (federated evaluation, docs/EVALUATION.md).
//
// SplitHeldOut takes a fraction of the site's own examples out of what it
// trains on, seeded, before the site is built: an image site keeps a seeded
// random choice of its examples apart, a text site a contiguous block of its
// tokens at a seeded position (windows never straddle the two). Instruction
// data keeps nothing apart. The held-out examples never train.
//
// EvaluatingTrainer wraps a site's Trainer: Train is the wrapped one's;
// Evaluate scores the round's global model on the held-out examples on the
// CPU (models::Evaluate for the classifiers: loss and accuracy;
// EvaluateLanguageModel for the language models: next-token loss and
// accuracy over the held-out tokens). A site without held-out examples, or a
// federation whose model it cannot score by itself (a lora or Hugging Face
// base federation, a custom model), answers that it does not evaluate.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "client/site.h"
#include "client/trainer.h"
#include "models/dataset.h"
#include "models/llama.h"
#include "models/model.h"

namespace estuary::client {

struct HeldOutData {
  std::shared_ptr<const models::Dataset> images;  // the held-out rows, copied out
  std::shared_ptr<const std::vector<int32_t>> text;
  uint64_t examples() const { return images ? images->size() : text ? text->size() : 0; }
};

// Moves `fraction` (in [0, 1)) of data's examples into the result, rounded
// down, seeded by `seed` (the site's name mixed in by the caller, so sites
// differ). Fraction 0, or instruction data: nothing is held out. Fails,
// naming the flag, when the fraction is out of range or would leave nothing to
// train on.
Result<HeldOutData> SplitHeldOut(SiteData* data, double fraction, uint64_t seed);

class EvaluatingTrainer : public Trainer {
 public:
  // `inner` outlives this trainer.
  EvaluatingTrainer(Trainer& inner, HeldOutData held) : inner_(inner), held_(std::move(held)) {}
  // Owns `inner` (a simulated site).
  EvaluatingTrainer(std::unique_ptr<Trainer> inner, HeldOutData held)
      : owned_(std::move(inner)), inner_(*owned_), held_(std::move(held)) {}

  uint64_t num_examples() const override { return inner_.num_examples(); }
  Result<Update> Train(std::span<const float> global, const Manifest& manifest, const v1::TaskConfig& task,
                       uint64_t round, std::string_view client_name) override {
    return inner_.Train(global, manifest, task, round, client_name);
  }
  Result<Update> TrainControlled(std::span<const float> global, const Manifest& manifest, const v1::TaskConfig& task,
                                 uint64_t round, std::string_view client_name, std::span<const float> control,
                                 std::span<const float> site_control) override {
    return inner_.TrainControlled(global, manifest, task, round, client_name, control, site_control);
  }
  Result<Evaluation> Evaluate(std::span<const float> global, const Manifest& manifest, const v1::TaskConfig& task,
                              uint64_t round, std::string_view client_name) override;

 private:
  std::unique_ptr<Trainer> owned_;
  Trainer& inner_;
  HeldOutData held_;
  // The model last scored, kept for the next evaluation round.
  std::string model_name_;
  std::unique_ptr<models::Model> classifier_;
  std::optional<models::Llama> language_model_;
};

}  // namespace estuary::client
