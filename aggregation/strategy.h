// Strategy: how the server merges client updates into the next global model.
//
// One round is Begin(round, global) -> Fold(delta, weight) for each accepted
// update -> Finish(new_global). Folding is streaming: the strategy holds O(model)
// accumulator state however many clients fold, and each delta is read once.
// Deltas are `local - global` in the global model's flat layout. State that
// must outlive a round (FedAdam's moments) is part of the strategy and goes
// into checkpoints through SaveState/LoadState. The same Strategy runs in the
// server and in the in-process simulator, so both produce the same model when
// they fold the same updates in the same order.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "models/low_rank.h"
#include "models/tensor.h"

namespace estuary::aggregation {

// A tensor the last Finish changed by a low-rank product:
// global[offset, offset + rows·cols) += delta (models::LowRankMatrix::AddTo).
struct LowRankChange {
  uint64_t offset = 0;
  models::LowRankMatrix delta;
};

// How a site trained for its update, as it reported it (UpdateBegin's
// local_steps and normalizer): τ_i, the optimizer steps it took, and a_i,
// FedNova's ‖a_i‖₁ (client/local_work.h): the sum of the coefficients with
// which its τ_i gradients entered its delta, in units of the learning rate.
// 0: not reported.
struct LocalWork {
  uint64_t steps = 0;
  double normalizer = 0;
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual std::string_view name() const = 0;

  // Before Begin: how many sites were sampled for the round, as planned
  // before training. Only strategies whose denominator must not depend on
  // who reports (DP-FedAvg, dp_fedavg.h) use it.
  virtual void PlanRound(uint64_t sampled) {}
  // Starts a round over a global model of global.size() parameters.
  virtual Status Begin(uint64_t round, std::span<const float> global) = 0;
  // Adds one client's delta with its weight (its number of examples).
  // Fails, touching nothing, if the size is wrong or the weight is not > 0.
  virtual Status Fold(std::span<const float> delta, double weight) = 0;
  // Adds one client's update whose layout is `layout` rather than the global
  // model's: a LoRA site's adapter factors (lora_strategy.h). `client` names
  // the sender in errors. Strategies over full deltas take only the global
  // layout, so by default this is Fold.
  virtual Status FoldUpdate(std::string_view client, const Manifest& layout, std::span<const float> values,
                            double weight) {
    return Fold(values, weight);
  }
  // The same for an update whose memory `owner` keeps alive (the server's
  // staged update): a strategy that must hold every update until Finish (a
  // robust rule) keeps `owner` and reads `values` there instead of copying
  // them; any other strategy folds it as FoldUpdate does and keeps nothing.
  virtual Status FoldShared(std::string_view client, const Manifest& layout, std::shared_ptr<const void> owner,
                            std::span<const float> values, double weight) {
    return FoldUpdate(client, layout, values, weight);
  }
  // FoldShared (owner set) or FoldUpdate (owner null) of an update with how
  // its site trained. Only strategies that weigh updates by the local work
  // behind them (FedNova, fednova.h) read `work`.
  virtual Status FoldWork(std::string_view client, const Manifest& layout, std::shared_ptr<const void> owner,
                          std::span<const float> values, double weight, const LocalWork& work) {
    return owner ? FoldShared(client, layout, std::move(owner), values, weight)
                 : FoldUpdate(client, layout, values, weight);
  }
  // Number of updates folded since Begin.
  virtual uint64_t folded() const = 0;
  // Writes the new global model into `global` (the same span given to Begin,
  // or another of the same size). Fails if nothing was folded.
  virtual Status Finish(std::span<float> global) = 0;

  // After Finish: the bytes a client that holds the previous global model
  // needs to form the new one, for strategies that change only part of it
  // (LoRA: the merged adapters, plus the residuals `exact` folds into the
  // base). 0 means the whole model changed.
  virtual uint64_t changed_bytes() const { return 0; }
  // After Finish: the tensors it changed by a low-rank product that is
  // smaller as factors than as the tensor (LoRA exact's residuals). A client
  // that holds the previous global model forms them from the factors, to the
  // same bits, instead of downloading them. In ascending offset; empty by default.
  virtual std::vector<LowRankChange> low_rank_changes() const { return {}; }

  // Cross-round state as named flat tensors (empty for stateless strategies).
  virtual std::map<std::string, std::vector<float>> SaveState() const { return {}; }
  virtual Status LoadState(const std::map<std::string, std::vector<float>>& state) { return Status::Ok(); }
};

struct StrategyOptions {
  // fedavg | fedavgm | fedadam | fedyogi | fedadagrad | fednova, or a robust
  // rule (robust_strategy.h): median | trimmed-mean | krum | multi-krum | bulyan
  std::string name = "fedavg";
  // The server's learning rate η: FedOpt's (fedopt.h) and FedAvgM's. Each
  // has its own default (DefaultServerLr).
  double server_lr = 0.01;
  // FedOpt (Reddi et al. 2021, Algorithm 2): betas and tau (fedadagrad has no beta2).
  double beta1 = 0.9;
  double beta2 = 0.99;
  double tau = 1e-3;
  // fedadam: divide m and v by (1 - beta^t) as Adam does (Kingma & Ba). Off by
  // default to follow Reddi et al. exactly; torch.optim.Adam corresponds to on.
  bool bias_correction = false;
  // FedAvgM (Hsu et al. 2019): the server momentum β.
  double server_momentum = 0.9;
  // Robust rules (robust.h). trimmed-mean: the fraction β trimmed from each
  // end per coordinate, in [0, 0.5).
  double trim = 0.1;
  // krum, multi-krum, bulyan: the number f of Byzantine updates tolerated.
  uint32_t byzantine = 1;
  // multi-krum: how many updates m to average; 0: n - f.
  uint32_t krum_select = 0;
  // N, the federation's sites: scaffold's c update divides by it (required),
  // a Poisson-sampled DP-FedAvg on the server its mean by q · N (config.h).
  uint32_t total_sites = 0;
};

// The strategies MakeStrategy knows, in the order --help lists them.
inline constexpr const char* kStrategyNames[] = {"fedavg",       "fedavgm",      "fedadam", "fedyogi",
                                                 "fedadagrad",   "fednova",      "scaffold", "median",
                                                 "trimmed-mean", "krum",         "multi-krum", "bulyan"};

// η where a federation leaves it unset: 1 for fedavgm (Hsu et al.'s setting,
// where β = 0 is FedAvg) and scaffold (Karimireddy et al.'s η_g = 1), 0.01
// for FedOpt (Reddi et al. tune it per task).
double DefaultServerLr(std::string_view strategy);

// Checks the numeric options: server_lr and tau finite and > 0, betas and
// server_momentum in [0, 1), bias_correction only under fedadam, trim in
// [0, 0.5), krum_select only under multi-krum, total_sites > 0 under
// scaffold, and a known name.
// MakeStrategy calls it. How many updates a robust rule needs (krum:
// n >= 2f + 3) depends on the round and is checked at its Finish.
Status ValidateStrategyOptions(const StrategyOptions& options);

// One of kStrategyNames; any other name is InvalidArgument naming it.
Result<std::unique_ptr<Strategy>> MakeStrategy(const StrategyOptions& options);

}  // namespace estuary::aggregation
