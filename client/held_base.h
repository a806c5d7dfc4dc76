// What a site does with its copy of a federation's Hugging Face base
// (estuary-client --base-model, models/hf_base.h): checks it against the task
// before it trains, and builds from it the model a patch on the base
// (RoundStart.patch_on_base) is applied to. The Agent's; apart so that it
// stays about the connection.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/manifest.h"
#include "base/status.h"
#include "estuary.pb.h"
#include "models/hf_base.h"

namespace estuary::client {

// Empty when `site` may train `task`: the task names no base, or `base`
// (null: the site holds none) has the task's shape and identity and, for a
// full task, training it fits this machine's memory (RefusalOfMemory).
// Otherwise the one line that refuses round `round`, naming both identities
// (or the memory's arithmetic).
std::string RefusalOfBase(const models::HfBase* base, const v1::TaskConfig& task, uint64_t round,
                          const std::string& site);

// Empty when the site trains whatever the task names (`expected` empty) or
// the task names `expected` (a site of a model known only as a file checks
// its own layout's name, models::CustomModelName); otherwise the one line
// that refuses round `round`, naming both models.
std::string RefusalOfModel(const std::string& expected, const v1::TaskConfig& task, uint64_t round,
                           const std::string& site);
// What a process of a site holds to train `task` in full (update kind full)
// on a base of shape `config`, in bytes: five fp32 copies of the weights
// (the held base, the global model received, the weights trained, their
// gradients, the update: the trained values less the global), plus the
// optimizer's state (AdamW: two moments; SGD with momentum: one) and the
// activation arena for batch x seq_len tokens. `terms` names them for the
// refusal line.
struct FullTrainingMemory {
  double parameters = 0;
  int copies = 0;            // fp32 copies of the weights
  std::string terms;         // what the copies are
  double activations = 0;    // bytes of the arena
  double bytes() const { return parameters * 4 * copies + activations; }
};
FullTrainingMemory FullTrainingMemoryOf(const models::LlamaConfig& config, const v1::TaskConfig& task);

// Empty when a full task on a base fits `limit` bytes (0: this machine's
// physical memory) or the task is not full training on a base; otherwise
// the one line that refuses round `round`, with its arithmetic. LoRA rounds
// hold one copy of the base and small adapters: not checked here.
std::string RefusalOfMemory(const models::LlamaConfig& config, const v1::TaskConfig& task, uint64_t round,
                            const std::string& site, uint64_t limit = 0);

// The model before a patch on the base: `base`'s weights where `manifest`
// begins with its tensors (same names, shapes and offsets), zero after
// them. Fails, naming the first tensor that differs, otherwise.
Result<std::vector<float>> ModelOnBase(const models::HfBase& base, const Manifest& manifest);

}  // namespace estuary::client
