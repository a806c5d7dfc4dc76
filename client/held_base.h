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
// (null: the site holds none) has the task's shape and identity. Otherwise
// the one line that refuses round `round`, naming both identities.
std::string RefusalOfBase(const models::HfBase* base, const v1::TaskConfig& task, uint64_t round,
                          const std::string& site);

// Empty when the site trains whatever the task names (`expected` empty) or
// the task names `expected` (a site of a model known only as a file checks
// its own layout's name, models::CustomModelName); otherwise the one line
// that refuses round `round`, naming both models.
std::string RefusalOfModel(const std::string& expected, const v1::TaskConfig& task, uint64_t round,
                           const std::string& site);

// The model before a patch on the base: `base`'s weights where `manifest`
// begins with its tensors (same names, shapes and offsets), zero after
// them. Fails, naming the first tensor that differs, otherwise.
Result<std::vector<float>> ModelOnBase(const models::HfBase& base, const Manifest& manifest);

}  // namespace estuary::client
