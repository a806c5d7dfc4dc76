// Federated evaluation's arithmetic: the sites' answers about one global
// model folded into the round log's RoundEvaluation. The server's evaluation
// rounds (coordinator_eval.cc) and the in-process simulator both use it, so
// both report the same figures for the same answers.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "server/store.h"

namespace estuary::server {

// Whether the model `round` committed is evaluated, every `every` rounds
// and after the last of `rounds` (every 0: never).
bool EvaluationDue(uint64_t round, uint64_t every, uint64_t rounds);
// The seed the sites asked to evaluate round r are drawn with (by
// aggregation::SampleClients, with r): the federation's seed mixed apart
// from the one its training rounds draw with.
uint64_t EvaluationSeed(uint64_t federation_seed);

// One selected site's answer. kFailed covers a site that dropped, did not
// answer before the deadline, or reported an error or unusable metrics.
struct SiteEvaluation {
  enum class Outcome { kEvaluated, kUnsupported, kFailed };
  Outcome outcome = Outcome::kFailed;
  uint64_t examples = 0;
  double loss = 0;                 // mean over its examples
  std::optional<double> accuracy;  // when its model has one
};

// The example-weighted means over the sites that evaluated (an evaluated site
// with no examples, or a loss or accuracy that is not finite, counts as
// failed); the others counted apart. A round none evaluated has examples 0,
// loss 0 and no accuracy.
RoundEvaluation AggregateEvaluations(const std::vector<SiteEvaluation>& sites, double seconds);

}  // namespace estuary::server
