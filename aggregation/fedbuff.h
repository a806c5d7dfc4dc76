// FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous
// Aggregation", AISTATS 2022, Algorithm 1): asynchronous rounds. Sites train
// continuously, each on the latest model version it pulled; the server folds
// every update as it arrives and steps the model once K have been folded:
//
//   Δ̄ += s(τ_i) Δ_i                     at each arrival, τ_i = version − v_i
//   x ← x + η_g Δ̄ / K,  version += 1     after the K-th, and Δ̄ ← 0
//
// where Δ_i = local − global is the site's delta from version v_i, s the
// staleness weight and η_g the server learning rate. The mean is over the K
// updates, unweighted by examples, as in the paper (its sites are sampled
// uniformly); a stale update is discounted by s(τ), not by its size. An
// update more than max_staleness versions old is refused and folds nothing.
//
// Staleness weights, the paper's and FedAsync's (Xie et al. 2019) forms:
//   constant      s(τ) = 1
//   poly:A        s(τ) = (1 + τ)^-A          (the paper's experiments: A = 0.5)
//   hinge:A,B     s(τ) = 1 if τ <= B, else 1 / (A (τ − B) + 1)
//
// FedBuff is not a Strategy (strategy.h): its unit is an arrival, not a
// round, and it needs the version each update trained from. Which
// federations it makes sense for is CheckFedBuffFederation's.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "aggregation/weighted_mean.h"
#include "base/status.h"
#include "federation.pb.h"

namespace estuary::aggregation {

struct StalenessWeight {
  enum class Kind { kConstant, kPoly, kHinge };
  Kind kind = Kind::kConstant;
  double a = 0;  // poly's exponent; hinge's slope
  double b = 0;  // hinge's knee: no discount up to B versions

  // s(τ), in (0, 1].
  double operator()(uint64_t staleness) const;
  // The form ParseStalenessWeight reads: "constant", "poly:0.5", "hinge:10,4".
  std::string ToString() const;
};

// "constant" | "poly:A" (A >= 0) | "hinge:A,B" (A >= 0, B >= 0), all finite;
// anything else is one line naming the text.
Result<StalenessWeight> ParseStalenessWeight(std::string_view text);

struct FedBuffOptions {
  uint32_t buffer = 10;    // K, the updates folded into one version, >= 1
  double server_lr = 1.0;  // η_g, finite and > 0
  StalenessWeight weight;
  // Updates with τ beyond this are refused; the default refuses none.
  uint64_t max_staleness = std::numeric_limits<uint64_t>::max();
};

Status ValidateFedBuffOptions(const FedBuffOptions& options);

// Refuses, in one line naming it, what asynchronous rounds cannot run: a
// strategy other than fedavg (the robust rules need a whole round's updates
// at once; SCAFFOLD's control variates and FedNova's normalisation are
// defined over a round's sites; the server optimizers are not FedBuff's
// step), a lora federation (its merge is not a mean of deltas), and DP-FedAvg
// (its noise and accountant are per sampled round). Secure aggregation is
// refused where it is asked for (estuary-sim --secagg).
Status CheckFedBuffFederation(const v1::FederationConfig& federation);

class FedBuff {
 public:
  // A server at model version `version` of a model of `size` parameters.
  static Result<FedBuff> Create(const FedBuffOptions& options, size_t size, uint64_t version = 0);

  struct Folded {
    uint64_t staleness = 0;
    double weight = 0;  // s(τ)
    bool full = false;  // K updates are buffered: call Step
  };
  // Folds a site's delta trained from model version `trained_from`. Fails,
  // buffering nothing: FailedPrecondition when τ > max_staleness or the
  // buffer is already full; InvalidArgument when trained_from is ahead of
  // version(), or the delta has the wrong size or a non-finite value.
  Result<Folded> Fold(std::span<const float> delta, uint64_t trained_from);

  // With K updates buffered: global += η_g Δ̄ / K, the version advances and
  // the buffer empties. Fails, writing nothing, when the buffer is not full,
  // the sizes differ or a parameter would leave float's range.
  Status Step(std::span<float> global);

  uint64_t version() const { return version_; }
  uint64_t buffered() const { return sum_.count(); }
  const FedBuffOptions& options() const { return options_; }

 private:
  FedBuff(const FedBuffOptions& options, size_t size, uint64_t version);

  FedBuffOptions options_;
  WeightedMean sum_;  // Σ s(τ_i) Δ_i of the buffered updates (in double)
  uint64_t version_ = 0;
};

}  // namespace estuary::aggregation
