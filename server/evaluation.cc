#include "server/evaluation.h"

#include <cmath>

#include "base/seed.h"

namespace estuary::server {

bool EvaluationDue(uint64_t round, uint64_t every, uint64_t rounds) {
  return every > 0 && round > 0 && round <= rounds && (round % every == 0 || round == rounds);
}

uint64_t EvaluationSeed(uint64_t federation_seed) {
  return MixSeed(federation_seed, std::string_view("federated evaluation"));
}

RoundEvaluation AggregateEvaluations(const std::vector<SiteEvaluation>& sites, double seconds) {
  RoundEvaluation out;
  out.selected = uint32_t(sites.size());
  out.seconds = seconds;
  double loss_sum = 0, correct = 0;
  for (const SiteEvaluation& site : sites) {
    const bool usable = site.outcome == SiteEvaluation::Outcome::kEvaluated && site.examples > 0 &&
                        std::isfinite(site.loss) && (!site.accuracy || std::isfinite(*site.accuracy));
    if (site.outcome == SiteEvaluation::Outcome::kUnsupported) {
      ++out.unsupported;
      continue;
    }
    if (!usable) {
      ++out.failed;
      continue;
    }
    ++out.reported;
    out.examples += site.examples;
    loss_sum += site.loss * double(site.examples);
    if (site.accuracy) {
      out.accuracy_examples += site.examples;
      correct += *site.accuracy * double(site.examples);
    }
  }
  if (out.examples > 0) out.loss = loss_sum / double(out.examples);
  if (out.accuracy_examples > 0) out.accuracy = correct / double(out.accuracy_examples);
  return out;
}

}  // namespace estuary::server
