#include "client/held_out.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "base/seed.h"
#include "models/language_model.h"

namespace estuary::client {

Result<HeldOutData> SplitHeldOut(SiteData* data, double fraction, uint64_t seed) {
  if (!(fraction >= 0 && fraction < 1)) {
    return InvalidArgument("--eval-split {}: must be in [0, 1) (the fraction of the site's examples held out)",
                           fraction);
  }
  HeldOutData held;
  if (fraction == 0 || data->instructions) return held;
  if (data->images) {
    const models::Dataset& all = *data->images;
    std::vector<uint32_t> indices = data->indices;
    if (indices.empty()) {
      indices.resize(all.size());
      std::iota(indices.begin(), indices.end(), 0u);
    }
    const uint64_t n = indices.size();
    const uint64_t k = uint64_t(std::floor(fraction * double(n)));
    if (k == 0) return held;
    if (k >= n) return InvalidArgument("--eval-split {}: would hold out all {} examples of the site", fraction, n);
    // A partial Fisher-Yates shuffle with the portable bounded draw: the
    // same seed picks the same examples on every platform.
    std::mt19937_64 rng(seed);
    for (uint64_t i = 0; i < k; ++i) std::swap(indices[i], indices[i + UniformBelow(rng, n - i)]);
    auto rows = std::make_shared<models::Dataset>();
    rows->feature_size = all.feature_size;
    rows->num_classes = all.num_classes;
    for (uint64_t i = 0; i < k; ++i) {
      rows->features.insert(rows->features.end(), all.row(indices[i]), all.row(indices[i]) + all.feature_size);
      rows->labels.push_back(all.labels[indices[i]]);
    }
    // The rest train, in their original order.
    std::vector<uint32_t> train(indices.begin() + int64_t(k), indices.end());
    std::sort(train.begin(), train.end());
    data->indices = std::move(train);
    held.images = std::move(rows);
    return held;
  }
  if (data->text) {
    const std::vector<int32_t>& tokens = *data->text;
    const uint64_t n = tokens.size();
    const uint64_t k = uint64_t(std::floor(fraction * double(n)));
    if (k == 0) return held;
    if (k >= n) return InvalidArgument("--eval-split {}: would hold out all {} tokens of the site", fraction, n);
    std::mt19937_64 rng(seed);
    const uint64_t at = UniformBelow(rng, n - k + 1);
    held.text = std::make_shared<const std::vector<int32_t>>(tokens.begin() + int64_t(at),
                                                            tokens.begin() + int64_t(at + k));
    auto train = std::make_shared<std::vector<int32_t>>(tokens.begin(), tokens.begin() + int64_t(at));
    train->insert(train->end(), tokens.begin() + int64_t(at + k), tokens.end());
    data->text = std::move(train);
  }
  return held;
}

Result<Evaluation> EvaluatingTrainer::Evaluate(std::span<const float> global, const Manifest& manifest,
                                               const v1::TaskConfig& task, uint64_t round,
                                               std::string_view client_name) {
  const std::string& name = task.model();
  // What this site cannot score by itself: it answers that it does not evaluate.
  const bool scorable = task.update_kind() == v1::UPDATE_FULL && !task.has_hf_base() &&
                        (held_.images ? !models::IsLanguageModel(name) : models::IsLanguageModel(name));
  if (held_.examples() == 0 || !scorable) return Evaluation{};
  if (name != model_name_) {
    classifier_.reset();
    language_model_.reset();
    if (held_.images) {
      ESTUARY_ASSIGN_OR_RETURN(classifier_, models::MakeModel(name));
      if (classifier_->input_size() != held_.images->feature_size) {
        return InvalidArgument("eval: held-out examples have {} features, model '{}' wants {}",
                               held_.images->feature_size, name, classifier_->input_size());
      }
    } else {
      ESTUARY_ASSIGN_OR_RETURN(const models::LlamaConfig config, models::LlamaPreset(name));
      ESTUARY_ASSIGN_OR_RETURN(models::Llama model, models::Llama::Create(config, 8));
      language_model_.emplace(std::move(model));
    }
    model_name_ = name;
  }
  Evaluation out;
  out.supported = true;
  models::EvalResult result;
  if (classifier_) {
    if (global.size() != classifier_->parameters().size()) {
      return InvalidArgument("eval: {} parameters for model '{}' of {}", global.size(), name,
                             classifier_->parameters().size());
    }
    std::copy(global.begin(), global.end(), classifier_->parameters().begin());
    result = models::Evaluate(*classifier_, held_.images->features.data(), held_.images->labels.data(),
                              held_.images->size());
  } else {
    const int seq = task.seq_len() > 0 ? int(task.seq_len()) : 128;
    // Every held-out window: a site's share is small.
    ESTUARY_ASSIGN_OR_RETURN(result, models::EvaluateLanguageModel(*language_model_, global, *held_.text, seq,
                                                                   uint64_t(held_.text->size())));
  }
  out.examples = result.examples;
  out.loss = result.loss;
  out.accuracy = result.accuracy;
  return out;
}

}  // namespace estuary::client
