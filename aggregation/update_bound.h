// UpdateBound: a federation's limits on one site's update (v1::UpdateLimits in
// proto/federation.proto), applied where updates are folded — the server's
// worker and the in-process simulator — so both fold the same values.
//
//   bound.BeginRound();                                   // this round's norm bound
//   ESTUARY_ASSIGN_OR_RETURN(auto admitted, bound.Admit(delta, examples));
//   strategy.FoldUpdate(client, layout, admitted.values(), weight);
//   ...
//   bound.CommitRound();                                  // its norms set the next round's bound
//
// An update whose L2 norm exceeds the round's bound is scaled down to it
// (norm bounding); the bound is max_norm, or max_norm_over_median times the
// median norm of the last committed round's updates, whichever is smaller.
// An update claiming more than max_examples examples, or whose values are
// not finite, is refused. An adapter upload (lora) is bounded the same way,
// as one vector: scaling it by s scales its B·A by s². The median survives a restart as
// state saved beside the strategy's (SaveState/LoadState).
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "federation.pb.h"

namespace estuary::aggregation {

class UpdateBound {
 public:
  explicit UpdateBound(const v1::UpdateLimits& limits);

  // What an update is folded as: its own values, or a scaled copy of them.
  class Admitted {
   public:
    std::span<const float> values() const { return scaled_.empty() ? values_ : std::span<const float>(scaled_); }
    double norm() const { return norm_; }    // as sent
    double scale() const { return scale_; }  // 1, or bound / norm
    // Empty, or "norm 1.2e+31 scaled down to the bound 3.4".
    const std::string& note() const { return note_; }

   private:
    friend class UpdateBound;
    std::span<const float> values_;  // as sent
    std::vector<float> scaled_;       // when scaled
    double norm_ = 0, scale_ = 1;
    std::string note_;
  };

  // Starts a round: its bound comes from the limits and the last committed round.
  void BeginRound();
  double bound() const { return bound_; }  // this round's norm bound; 0: none
  // `values` must outlive the result when it is not scaled.
  Result<Admitted> Admit(std::span<const float> values, uint64_t examples);
  // The round committed: the norms admitted in it, as folded (an outlier at
  // the bound), become the median the next round's relative bound is taken
  // from.
  void CommitRound();

  std::map<std::string, std::vector<float>> SaveState() const;
  Status LoadState(const std::map<std::string, std::vector<float>>& state);

 private:
  v1::UpdateLimits limits_;
  double bound_ = 0;
  double median_ = 0;          // of the last committed round's norms; 0: none yet
  std::vector<double> norms_;  // this round's, as folded
};

}  // namespace estuary::aggregation
