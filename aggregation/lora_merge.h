// LoRA merging: how the server turns the clients' adapters for one adapted
// weight W [out, in] (a "module") into the adapter the next round starts from.
//
// A client's adapter is A [rank, in], B [out, rank] and alpha; its update is
// ΔW = (alpha / rank) · B · A. Three rules, selected per federation:
//   naive    averages A and B separately (what most frameworks do). Needs equal
//            ranks and alphas. Not the average update: mean(B)·mean(A) ≠ mean(B·A).
//   exact    (FedEx-LoRA) the merged model equals base + Σ w_i ΔW_i to fp32
//            rounding: new rank-r factors from a truncated SVD of the average,
//            plus the residual the truncation drops, to be added to the base
//            weight. Clients may have different ranks and alphas.
//   frozen-a (FFA-LoRA) A is fixed and shared, only B is trained and averaged,
//            which is exact by construction. Refuses clients whose A differ.
// Weights are the clients' example counts; they are normalised here.
// Matrices are row-major fp32.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "models/low_rank.h"

namespace estuary::aggregation {

struct LoraAdapter {
  size_t rank = 0, in = 0, out = 0;
  float alpha = 0;
  std::vector<float> a = {};  // [rank, in]
  std::vector<float> b = {};  // [out, rank]

  double scale() const { return double(alpha) / double(rank); }
  // Bytes of the two factors in fp32, as they travel on the wire.
  uint64_t bytes() const { return uint64_t(4) * rank * (in + out); }
};

// ΔW = (alpha / rank) · B · A as a dense [out, in] matrix.
std::vector<float> LoraDelta(const LoraAdapter& adapter);

enum class LoraMergeRule { kNaive, kExact, kFrozenA };
// "naive" | "exact" | "frozen-a"; anything else is InvalidArgument naming it.
Result<LoraMergeRule> ParseLoraMergeRule(std::string_view name);
std::string_view LoraMergeRuleName(LoraMergeRule rule);

struct LoraMergeOptions {
  LoraMergeRule rule = LoraMergeRule::kExact;
  // exact only: the federation's rank and alpha for the merged adapter. naive
  // and frozen-a keep the clients' (equal) rank and alpha.
  size_t rank = 8;
  float alpha = 16;
};

struct MergedLoraModule {
  LoraAdapter adapter;
  // exact only: ΔW_avg − (alpha/rank)·B'·A', [out, in], to add to the base
  // weight (with LowRankMatrix::AddTo), as the factors it is made of:
  // u = [w_1 s_1 B_1, ..., w_n s_n B_n, −s B'] and v = [A_1; ...; A_n; A'],
  // rank Σ rank_i + rank. Empty when nothing was truncated: rank(ΔW_avg) ≤
  // rank, up to a dropped part below fp32 rounding of ΔW_avg
  // (‖dropped‖_F ≤ 2^-23 ‖ΔW_avg‖_F).
  models::LowRankMatrix residual = {};
  // exact only: every singular value of ΔW_avg that its factors can carry
  // (min(Σ rank_i, out, in) of them), descending. The first `rank` are kept;
  // if there are fewer, the adapter's remaining rows of A and columns of B are
  // zero (a trainer must re-initialise them: LoRA's gradients vanish there).
  std::vector<double> singular_values = {};

  // What the residual costs a client that holds the previous base: its
  // factors, or the dense [out, in] weight where that is smaller.
  uint64_t residual_bytes() const {
    return residual.empty() ? 0 : std::min(residual.factor_bytes(), residual.dense_bytes());
  }
};

// Merges the clients' adapters for one module. `module` only names it in
// errors. Fails, with a message naming the client, the module and the field,
// on a malformed adapter (factor sizes, non-finite values), a shape (in, out)
// that differs from client 0's, a rank or alpha the rule needs equal, an A
// that differs under frozen-a, or a weight not finite and > 0.
Result<MergedLoraModule> MergeLoraModule(std::string_view module, std::span<const LoraAdapter> clients,
                                         std::span<const double> weights, const LoraMergeOptions& options);

// One client's update: its adapters by module name
// (e.g. "model.layers.0.self_attn.q_proj").
struct LoraUpdate {
  std::map<std::string, LoraAdapter> modules;

  uint64_t bytes() const;
};

// The bad-input check across clients, before anything is merged: every
// client has client 0's module names, and per module the same (in, out), and
// — where the rule needs it — the same rank and alpha. Returns the first
// mismatch in (client, module) order, naming client index, module and field.
Status CheckLoraUpdates(std::span<const LoraUpdate> clients, LoraMergeRule rule);

struct LoraMergeResult {
  std::map<std::string, MergedLoraModule> modules;
  uint64_t adapter_bytes = 0;   // the merged adapters the server sends back (frozen-a: the B factors)
  uint64_t residual_bytes = 0;  // exact: the residuals sent back for the base (MergedLoraModule::residual_bytes)
};

// CheckLoraUpdates, then MergeLoraModule for every module.
Result<LoraMergeResult> MergeLoraUpdates(std::span<const LoraUpdate> clients, std::span<const double> weights,
                                         const LoraMergeOptions& options);

}  // namespace estuary::aggregation
