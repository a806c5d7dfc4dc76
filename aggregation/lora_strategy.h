// LoraStrategy: the server side of a federation whose update kind is `lora`.
//
// The global model is a LoRA global layout (models/lora_federation.h): the
// frozen base, then the global adapter. Each site starts a round from it,
// trains its adapter and uploads the factors (under frozen-a only B). The
// strategy validates each upload's layout against the federation's LoRA
// config (CheckLoraUpload: names, ranks, shapes), keeps the accepted
// adapters, and at Finish merges them with MergeLoraUpdates:
//   naive     the global adapter becomes (mean B, mean A); the base is kept.
//   exact     the global adapter becomes the rank-r truncation of the
//             weighted mean of (alpha/r_i)·B_i·A_i and the residual is added
//             to the base weight, so base + adapter is exactly the average of
//             the sites' adapted models (FedEx-LoRA).
//   frozen-a  the global A stays; B becomes mean B (FFA-LoRA).
// Unlike the full-delta strategies it holds every folded update until Finish
// (an exact merge needs all factors at once): O(clients × adapter), which for
// an adapter is small (2.25 MiB for the 124M decoder at rank 8).
#pragma once

#include <string>
#include <vector>

#include "aggregation/lora_merge.h"
#include "aggregation/strategy.h"
#include "models/lora_federation.h"

namespace estuary::aggregation {

struct LoraStrategyOptions {
  models::LoraGlobalLayout layout;
  // rule; rank and alpha are the federation's (the global adapter's).
  LoraMergeOptions merge;
  // exact only: sites may upload adapters of another rank than the
  // federation's (their (alpha/r_i) then scales by their own rank).
  bool mixed_ranks = false;
};

// The upload layout the federation expects from a site: every adapter
// tensor, or the B tensors under frozen-a.
Manifest ExpectedLoraUpload(const LoraStrategyOptions& options);

// Checks a site's upload layout before any of it is staged: the tensors of
// ExpectedLoraUpload in that order, f32, each A [r, in] and B [out, r] with
// the federation's in and out and r its rank (any r > 0, the same for A and
// B, with mixed_ranks). The message is one line naming the client, the module
// and the field: "lora update from site-3: module ...q_proj: lora_A rank 4,
// the federation's is 8".
Status CheckLoraUpload(std::string_view client, const Manifest& upload, const LoraStrategyOptions& options);

// Validates the options themselves (mixed_ranks only under exact; the
// layout's adapter of the federation's rank).
Status ValidateLoraStrategyOptions(const LoraStrategyOptions& options);

class LoraStrategy final : public Strategy {
 public:
  explicit LoraStrategy(LoraStrategyOptions options);
  static Result<std::unique_ptr<Strategy>> Make(LoraStrategyOptions options);

  std::string_view name() const override { return name_; }
  Status Begin(uint64_t round, std::span<const float> global) override;
  // An upload in the federation's own upload layout (ExpectedLoraUpload).
  Status Fold(std::span<const float> values, double weight) override;
  // CheckLoraUpload, then every value finite and the weight > 0; on failure
  // nothing is kept.
  Status FoldUpdate(std::string_view client, const Manifest& layout, std::span<const float> values,
                    double weight) override;
  uint64_t folded() const override { return updates_.size(); }
  Status Finish(std::span<float> global) override;
  uint64_t changed_bytes() const override { return changed_bytes_; }
  // exact: the residuals folded into base weights, where factors are smaller.
  std::vector<LowRankChange> low_rank_changes() const override { return low_rank_changes_; }

  // The last Finish's merge: adapter and residual bytes (LoraMergeResult).
  uint64_t adapter_bytes() const { return adapter_bytes_; }
  uint64_t residual_bytes() const { return residual_bytes_; }

 private:
  LoraStrategyOptions options_;
  Manifest expected_;
  std::string name_;
  std::vector<float> global_adapter_;  // from Begin: frozen-a takes A from here
  std::vector<LoraUpdate> updates_;
  std::vector<LowRankChange> low_rank_changes_;
  std::vector<double> weights_;
  uint64_t changed_bytes_ = 0, adapter_bytes_ = 0, residual_bytes_ = 0;
};

}  // namespace estuary::aggregation
