// DpFedAvg: DP-FedAvg with central Gaussian noise (McMahan et al. 2018,
// "Learning Differentially Private Recurrent Language Models"), as a step
// around the federation's strategy (FedAvg, FedAdam or a LoRA merge).
//
// Each site's update x_i (a full delta, or a LoRA upload minus the global
// adapter's same tensors) is clipped to L2 norm C, x_i · min(1, C/‖x_i‖), and
// summed with weight 1. At Finish the sum gets N(0, (z·C)²) per coordinate and
// is divided by the number of sites sampled for the round as planned before
// training (PlanRound), not by the number that reported: a site that drops out
// then changes only the sum, whose sensitivity stays C, never the
// denominator. The noised mean is handed to the inner strategy as one update
// of weight 1, so FedAdam's server optimiser and the LoRA merges see only
// released values.
//
// Equal weights, not examples: a site's weight is its own claim of how many
// examples it holds; weighting by it would let one site scale its clipped
// update past C and void the sensitivity bound the noise is calibrated to.
//
// Adaptive clipping (Andrew et al. 2021, "Differentially Private Learning with
// Adaptive Clipping"): each site also reports whether ‖x_i‖ ≤ C, as the
// centred bit b_i − ½ (sensitivity ½); the server releases
//   b̃ = clamp((Σ(b_i − ½) + N(0, σ_b²)) / k + ½, 0, 1)
// and moves C geometrically toward the target quantile γ:
//   C ← C · exp(−η (b̃ − γ)).
// The two releases share the budget of the total noise multiplier z: the sum
// is noised with z_Δ = (z⁻² − (2σ_b)⁻²)^(−½), which needs z < 2σ_b; σ_b is
// 0.05·k by default (TensorFlow Federated's choice). C survives restarts in
// the strategy's saved state, rounded to float each round so a resumed run
// continues exactly where an uninterrupted one would.
//
// Noise comes from GaussianStream (dp_noise.h): unpredictable on a server,
// seeded from (seed, round) in the simulator.
#pragma once

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "aggregation/dp_noise.h"
#include "aggregation/lora_strategy.h"
#include "aggregation/strategy.h"

namespace estuary::aggregation {

struct DpOptions {
  double noise_multiplier = 1.0;  // z
  double clip = 1.0;              // C; with adaptive clipping, its starting value
  bool adaptive = false;
  double target_quantile = 0.5;     // γ
  double clip_lr = 0.2;             // η
  double clipped_count_stddev = 0;  // σ_b; 0: 0.05 · sampled sites
  // Seeded noise for simulations (reproducible, not private against whoever
  // knows the seed); otherwise keyed from RAND_bytes every round.
  std::optional<uint64_t> seed;
};

// Where a LoRA federation's upload sits in the global model: the upload
// layout, and for each of its tensors in order the global offset of the
// adapter tensor of the same name.
struct DpUploadReference {
  Manifest upload;
  std::vector<std::pair<uint64_t, uint64_t>> slices;  // (global offset, elements)
};
Result<DpUploadReference> LoraUploadReference(const LoraStrategyOptions& options);

// What the last Finish released, for the round log.
struct DpRound {
  double clip = 0;            // C the round's updates were clipped to
  double noise_stddev = 0;    // of the noise on each coordinate of the sum: z_Δ · C
  uint64_t sampled = 0;       // the sites sampled
  double denominator = 0;     // the fixed denominator: sampled, or q · population under Poisson sampling
  uint64_t clipped = 0;       // updates whose norm exceeded C
  double unclipped_estimate = 0;  // b̃ (adaptive only)
};

class DpFedAvg final : public Strategy {
 public:
  // `reference` for a LoRA federation, whose uploads are factors, not deltas.
  DpFedAvg(std::unique_ptr<Strategy> inner, DpOptions options, std::optional<DpUploadReference> reference);

  std::string_view name() const override { return name_; }
  // The round's denominator: the number of sites sampled for it.
  void PlanRound(uint64_t sampled) override { planned_ = sampled; }
  // Poisson sampling (serve --sample-rate): the next round's denominator is
  // the expected number of sites, q · population, not the number drawn; a
  // constant, so one site's presence changes only the sum. Before Begin,
  // after PlanRound; 0: the planned count.
  void PlanExpected(double expected) { planned_expected_ = expected; }
  Status Begin(uint64_t round, std::span<const float> global) override;
  Status Fold(std::span<const float> delta, double weight) override;
  // A LoRA upload must have the federation's upload layout (no mixed ranks).
  Status FoldUpdate(std::string_view client, const Manifest& layout, std::span<const float> values,
                    double weight) override;
  uint64_t folded() const override { return folded_; }
  Status Finish(std::span<float> global) override;
  uint64_t changed_bytes() const override { return inner_->changed_bytes(); }
  std::vector<LowRankChange> low_rank_changes() const override { return inner_->low_rank_changes(); }

  std::map<std::string, std::vector<float>> SaveState() const override;
  Status LoadState(const std::map<std::string, std::vector<float>>& state) override;

  double clip() const { return clip_; }  // for the next round
  const DpRound& last_round() const { return last_; }

  // z_Δ: the noise multiplier of the sum when k sites are sampled (z itself
  // without adaptive clipping). Fails when adaptive clipping's σ_b leaves no
  // budget for the sum (z ≥ 2σ_b).
  static Result<double> SumNoiseMultiplier(const DpOptions& options, uint64_t sampled);

 private:
  Status Accumulate(std::span<const float> x, std::string_view client);

  std::unique_ptr<Strategy> inner_;
  DpOptions options_;
  std::optional<DpUploadReference> reference_;
  std::string name_;
  double clip_;
  uint64_t planned_ = 0;
  double planned_expected_ = 0;
  double denominator_ = 0;
  // The open round.
  bool round_open_ = false;
  uint64_t round_ = 0, sampled_ = 0, folded_ = 0, unclipped_ = 0;
  std::vector<double> sum_;
  std::vector<float> reference_values_;  // LoRA: the global adapter in upload layout
  std::optional<GaussianStream> noise_;
  DpRound last_;
};

}  // namespace estuary::aggregation
