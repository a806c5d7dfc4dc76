// The base decoder the fortunes studies start from (lora-fortunes,
// instruct-fortunes): a byte-level preset pretrained centrally on the
// fortunes topics no site holds, by the trainer a site runs, and saved as
// safetensors in Hugging Face's names; or a base an earlier run saved.
//
// The topics' text is split as the simulator's text workload splits it
// (models::LoadFortunes with test_fraction 0.1 and the seed), so a study's
// sites and this pretraining see disjoint text. Everything derives from the
// seed: a rerun pretrains the same base bit for bit.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "base/status.h"
#include "models/llama.h"
#include "models/federated_model.h"
#include "models/text_corpus.h"

namespace estuary::simulations {

struct FortunesBaseOptions {
  std::filesystem::path data_dir;
  std::vector<std::string> site_topics;  // held by the sites; every other topic pretrains
  std::string model;                     // a byte-level preset (llama-tiny, llama-small)
  uint32_t seq_len = 64;
  uint32_t batch = 16;
  uint32_t pretrain_steps = 1500;
  float pretrain_lr = 3e-3f;
  uint64_t seed = 2017;
  std::filesystem::path workdir;     // base.safetensors lands here
  std::filesystem::path base_model;  // given: loaded instead of pretrained
  std::string study;                 // names the study in errors ("lora-fortunes: ...")
};

struct FortunesBase {
  models::LlamaConfig config;
  models::InitialWeights initial;  // the preset from the seed, before pretraining
  std::vector<float> weights;      // the base
  std::filesystem::path path;      // its safetensors
  uint64_t pretrain_tokens = 0;    // 0 when given
  double pretrain_loss = 0;
  std::vector<models::TextSource> sources;        // every topic, split
  std::map<std::string, size_t> source_of_topic;  // index into sources

  const models::TextSource& Topic(const std::string& name) const { return sources[source_of_topic.at(name)]; }
};

// The base options of a study's options `o` (any struct with the same
// names: LoraFortunesOptions, InstructFortunesOptions).
template <typename StudyOptions>
FortunesBaseOptions BaseOptionsOf(const StudyOptions& o, std::vector<std::string> site_topics, std::string study) {
  return {.data_dir = o.data_dir,
          .site_topics = std::move(site_topics),
          .model = o.model,
          .seq_len = o.seq_len,
          .batch = o.batch,
          .pretrain_steps = o.pretrain_steps,
          .pretrain_lr = o.pretrain_lr,
          .seed = o.seed,
          .workdir = o.workdir,
          .base_model = o.base_model,
          .study = std::move(study)};
}

using FortunesProgress = std::function<void(const std::string& what)>;

// Fails naming the study and the problem: a model that is not byte-level,
// topics that repeat or are missing, nothing left to pretrain on.
Result<FortunesBase> MakeFortunesBase(const FortunesBaseOptions& options, const FortunesProgress& say);

// An epoch count large enough that `steps` batches of `batch` windows fit
// (the step cap ends the training).
uint32_t EpochsFor(uint64_t steps, uint64_t windows, uint32_t batch);

}  // namespace estuary::simulations
