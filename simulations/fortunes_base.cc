#include "simulations/fortunes_base.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "aggregation/federation.h"
#include "client/site.h"
#include "models/checkpoint.h"
#include "models/language_model.h"
#include "models/lora_federation.h"

namespace estuary::simulations {

namespace fs = std::filesystem;

uint32_t EpochsFor(uint64_t steps, uint64_t windows, uint32_t batch) {
  const uint64_t per_epoch = std::max<uint64_t>(1, (windows + batch - 1) / batch);
  return uint32_t(std::min<uint64_t>(1000, steps / per_epoch + 1));
}

Result<FortunesBase> MakeFortunesBase(const FortunesBaseOptions& o, const FortunesProgress& progress) {
  auto say = [&](const std::string& what) {
    if (progress) progress(what);
  };
  FortunesBase out;
  ESTUARY_ASSIGN_OR_RETURN(out.config, models::LlamaPreset(o.model));
  if (out.config.vocab_size != models::ByteTokenizer::kVocabSize) {
    return InvalidArgument("{}: {} is not a byte-level model", o.study, o.model);
  }
  ESTUARY_ASSIGN_OR_RETURN(out.sources, models::LoadFortunes(o.data_dir, {.test_fraction = 0.1,
                                                                          .seed = o.seed,
                                                                          .min_tokens = o.seq_len + 1}));
  const std::set<std::string> held(o.site_topics.begin(), o.site_topics.end());
  if (held.size() != o.site_topics.size() || o.site_topics.empty()) {
    return InvalidArgument("{}: --topics '{}' must name distinct topics", o.study, fmt::join(o.site_topics, ","));
  }
  std::vector<int32_t> pretrain;
  for (size_t i = 0; i < out.sources.size(); ++i) {
    const models::TextSource& source = out.sources[i];
    out.source_of_topic[source.name] = i;
    if (!held.contains(source.name)) pretrain.insert(pretrain.end(), source.train.begin(), source.train.end());
  }
  for (const auto& topic : o.site_topics) {
    if (!out.source_of_topic.contains(topic)) {
      return InvalidArgument("{}: {} has no topic '{}' with enough text", o.study, o.data_dir.string(), topic);
    }
  }
  if (o.base_model.empty() && pretrain.size() < size_t(o.seq_len + 1)) {
    return InvalidArgument("{}: the topics outside --topics hold {} tokens: nothing to pretrain on", o.study,
                           pretrain.size());
  }
  std::error_code ec;
  fs::create_directories(o.workdir, ec);
  if (ec) return IoError("{}: {}: {}", o.study, o.workdir.string(), ec.message());
  ESTUARY_ASSIGN_OR_RETURN(out.initial, models::InitialModel(o.model, o.seed));
  if (!o.base_model.empty()) {
    ESTUARY_ASSIGN_OR_RETURN(out.weights, models::LoadBaseWeights(o.base_model, out.config));
    out.path = o.base_model;
    say(fmt::format("base loaded from {}", o.base_model.string()));
    return out;
  }
  // The preset from the seed, trained centrally by the trainer a site runs.
  v1::TaskConfig pretraining = aggregation::DefaultFederation().task();
  pretraining.clear_lora();
  pretraining.set_model(o.model);
  pretraining.set_batch_size(o.batch);
  pretraining.set_seq_len(o.seq_len);
  pretraining.set_seed(o.seed);
  pretraining.set_optimizer("adamw");
  pretraining.set_learning_rate(o.pretrain_lr);
  pretraining.set_max_local_steps(o.pretrain_steps);
  pretraining.set_epochs(EpochsFor(o.pretrain_steps, (pretrain.size() - 1) / o.seq_len, o.batch));
  out.pretrain_tokens = pretrain.size();
  say(fmt::format("pretraining {} on {} bytes of the other topics for {} steps", o.model, pretrain.size(),
                  o.pretrain_steps));
  ESTUARY_ASSIGN_OR_RETURN(
      auto pretrainer,
      client::MakeLocalSite({.text = std::make_shared<const std::vector<int32_t>>(std::move(pretrain))}, {}));
  ESTUARY_ASSIGN_OR_RETURN(client::Update pretrained, pretrainer->Train(out.initial.values, out.initial.manifest,
                                                                        pretraining, 0, "pretraining"));
  out.weights = out.initial.values;
  for (size_t i = 0; i < out.weights.size(); ++i) out.weights[i] += pretrained.payload[i];
  out.pretrain_loss = pretrained.train_loss;
  out.path = o.workdir / "base.safetensors";
  ESTUARY_RETURN_IF_ERROR(models::SaveCheckpoint(out.path, out.initial.manifest, out.weights,
                                                 {{"model", o.model},
                                                  {"pretrain_tokens", std::to_string(out.pretrain_tokens)},
                                                  {"pretrain_steps", std::to_string(o.pretrain_steps)}}));
  say(fmt::format("base saved to {} (train loss {:.3f} nats/byte)", out.path.string(), pretrained.train_loss));
  return out;
}

}  // namespace estuary::simulations
