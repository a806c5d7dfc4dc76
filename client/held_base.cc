#include "client/held_base.h"

#include <fmt/format.h>

#include <algorithm>

#include "crypto/sha256.h"

namespace estuary::client {

std::string RefusalOfBase(const models::HfBase* base, const v1::TaskConfig& task, uint64_t round,
                          const std::string& site) {
  if (!task.has_hf_base()) return {};
  const std::string& theirs = task.hf_base().sha256();
  if (!base) {
    return fmt::format("{}: refused round {}: the federation's base model is {} (sha256 {}), which this site does "
                       "not hold (start it with --base-model DIR)",
                       site, round, task.model(), theirs);
  }
  std::string why;
  if (const std::string difference = models::FirstShapeDifference(base->shape, task.hf_base().shape());
      !difference.empty()) {
    why = fmt::format("its config differs ({}, this site's vs the federation's)", difference);
  } else if (!crypto::SameHexDigest(base->sha256, theirs)) {
    why = "its weights differ";
  } else {
    return RefusalOfMemory(base->config, task, round, site);
  }
  return fmt::format("{}: refused round {}: base model {} has sha256 {}, the federation's ({}) has sha256 {}: {}", site,
                     round, base->dir.string(), base->sha256, task.model(), theirs, why);
}

std::string RefusalOfModel(const std::string& expected, const v1::TaskConfig& task, uint64_t round,
                           const std::string& site) {
  if (expected.empty() || task.model() == expected) return {};
  return fmt::format("{}: refused round {}: the federation trains {}, this site's model is {}", site, round,
                     task.model(), expected);
}

FullTrainingMemory FullTrainingMemoryOf(const models::LlamaConfig& config, const v1::TaskConfig& task) {
  FullTrainingMemory m;
  m.parameters = config.ParameterCount();
  m.copies = 5;
  m.terms = "the held base, the global model, weights, gradients, the update";
  if (task.optimizer() == "adamw") {
    m.copies += 2;
    m.terms += ", AdamW's two moments";
  } else if (task.momentum() > 0) {
    m.copies += 1;
    m.terms += ", SGD's momentum";
  }
  models::LlamaConfig trained = config;
  trained.max_seq_len = int(std::max<uint32_t>(task.seq_len(), 1));
  m.activations = trained.ActivationsPerSequence() * std::max<uint32_t>(task.batch_size(), 1) * sizeof(float);
  return m;
}

std::string RefusalOfMemory(const models::LlamaConfig& config, const v1::TaskConfig& task, uint64_t round,
                            const std::string& site, uint64_t limit) {
  if (!task.has_hf_base() || task.update_kind() != v1::UPDATE_FULL) return {};
  const FullTrainingMemory m = FullTrainingMemoryOf(config, task);
  const bool physical = limit == 0;
  const double have = physical ? double(models::PhysicalMemoryBytes()) : double(limit);
  if (m.bytes() <= have) return {};
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  return fmt::format(
      "{}: refused round {}: training {} in full needs {:.0f} parameters x 4 bytes x {} ({}) + {:.0f} bytes of "
      "activations for {} x {} tokens = {:.0f} bytes ({:.2f} GiB), more than the {:.0f} bytes ({:.2f} GiB) of {}",
      site, round, task.model(), m.parameters, m.copies, m.terms, m.activations, task.batch_size(), task.seq_len(),
      m.bytes(), m.bytes() / kGiB, have, have / kGiB, physical ? "this machine's physical memory" : "its limit");
}

Result<std::vector<float>> ModelOnBase(const models::HfBase& base, const Manifest& manifest) {
  for (size_t i = 0; i < base.manifest.tensors.size(); ++i) {
    const TensorSpec& want = base.manifest.tensors[i];
    if (i >= manifest.tensors.size() || manifest.tensors[i].name != want.name ||
        manifest.tensors[i].shape != want.shape || manifest.tensors[i].offset != want.offset) {
      return InvalidArgument("the model's manifest does not begin with base model {}'s tensor {}", base.dir.string(),
                             want.name);
    }
  }
  std::vector<float> model(manifest.total_elements, 0.0f);
  if (base.weights.size() > model.size()) {
    return InvalidArgument("base model {} holds more weights than the model", base.dir.string());
  }
  std::copy(base.weights.begin(), base.weights.end(), model.begin());
  return model;
}

}  // namespace estuary::client
