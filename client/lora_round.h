// LoraRound: a site's round of a lora federation, apart from its batches —
// what the site's adapted model starts from and what it uploads. The
// single-process TextTrainer and every rank of a multi-rank site
// (client/site.h) use it, so both train and upload the same thing.
//
// The global buffer is a LoRA global layout (models/lora_federation.h): the
// frozen base, then the global adapter. A site of the federation's rank
// trains that adapter on that base; under frozen-a A must stay the
// federation's, and only B is uploaded. A site of its own rank (exact merge,
// mixed ranks) folds the global adapter into its base, trains a fresh adapter
// of its rank and uploads both as one stacked adapter of rank r + r_i that
// represents its model exactly.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "client/trainer.h"
#include "models/lora.h"
#include "models/lora_federation.h"
#include "models/tensor.h"

namespace estuary::client {

// The LoRA part of a task: a valid LoraConfig, a known merge rule, mixed
// ranks only under exact.
Status ValidateLoraTask(const LoraTask& lora);

// "rank/alpha/dropout/targets": what tells adapted models apart, for the
// caches of them (one per model, batch and adapter config).
std::string LoraConfigKey(const models::LoraConfig& lora);

struct LoraRound {
  models::LoraGlobalLayout layout;  // the federation's
  models::LoraConfig federation;    // the task's adapter config
  models::LoraConfig site;          // the adapter this site trains: the federation's, or of its own rank
  models::LoraLayout site_layout;   // its layout (for the federation's rank, layout.adapter's)
  bool own_rank = false;
  bool frozen_a = false;            // A is the federation's: put back after every step, not uploaded
};

// Checks a lora task against this site (site_rank: its own adapter rank, 0
// for the federation's); every failure is one line naming what does not fit.
Result<LoraRound> PlanLoraRound(const TaskConfig& task, int site_rank);
// The global buffer is the federation's layout: base, then adapter.
Status CheckLoraGlobal(const LoraRound& plan, const TaskConfig& task, const Manifest& manifest,
                       size_t global_size);

// What the site's model starts from in `round`: the frozen base, the adapter
// and the dropout masks' seed. Every rank computes the same start.
struct LoraStart {
  std::span<const float> global_base;  // the global buffer's base part
  std::vector<float> folded_base;      // own rank: the global adapter added into the base
  std::vector<float> adapter;          // in the site's layout
  uint64_t dropout_seed = 0;

  std::span<const float> base() const { return folded_base.empty() ? global_base : folded_base; }
};
Result<LoraStart> StartLoraRound(const LoraRound& plan, std::span<const float> global, const TaskConfig& task,
                                 uint64_t round, std::string_view client_name);

// frozen-a: A is the federation's and must not move, yet AdamW's decay would
// move it even with a zero gradient; so a rank model keeps the adapter as
// its round starts and puts every A back after each step.
class FrozenA {
 public:
  // Keeps `adapter` when the task's merge is frozen-a, else forgets it.
  void Start(const TaskConfig& task, std::span<const float> adapter);
  bool active() const { return !kept_.empty(); }
  // put(offset, values) for each lora_A tensor of `manifest` (the adapter's).
  Status Restore(const Manifest& manifest,
                 const std::function<Status(uint64_t offset, std::span<const float> values)>& put) const;

 private:
  std::vector<float> kept_;
};

// The upload from the trained adapter (the site's layout): its factors under
// PEFT's names (only B under frozen-a), or the stacked adapter of an own
// rank. Fails when the loss is not finite: a diverged site sends nothing.
Result<Update> LoraUpdateOf(const LoraRound& plan, std::span<const float> global, std::span<const float> trained,
                            uint64_t num_examples, double train_loss, std::chrono::steady_clock::time_point start,
                            uint64_t round);

}  // namespace estuary::client
