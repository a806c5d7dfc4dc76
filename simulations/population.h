// A population of simulated image sites larger than any that could be built
// (estuary-sim --examples-per-client K): each site draws its K examples from
// the training set with its own seed (site_draws.h), and is made — examples,
// trainer, attack, straggling — only when a round samples it, then dropped.
// Nothing is kept or drawn for a site that is not sampled, so memory and a
// round's time follow the sites sampled, not the population (a round of 100
// from 1,000,000 sites costs what a round of 100 from 10,000 does).
//
// Sites are named client-NNN, zero-padded to the widest index (client-000042
// of a million), so their names sort in index order and a round's sample,
// aggregation::SampleIndices, is the server's SampleClients over those names:
// a loopback run samples the sites an in-process run does.
//
// Poisson sampling (--sample-rate q) takes the successes of the N Bernoulli(q)
// trials, drawn as the geometric gaps between them from (seed, round):
// O(sites drawn), whatever N is.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "client/trainer.h"
#include "models/dataset.h"
#include "simulations/attack.h"
#include "simulations/runner.h"
#include "simulations/site_draws.h"
#include "simulations/stragglers.h"

namespace estuary::simulations {

struct Workload;

class Population {
 public:
  // The scenario's image sites under --examples-per-client; fails in one line
  // when its data cannot give them (site_draws.h) or a flag is malformed.
  static Result<std::shared_ptr<const Population>> Create(const Scenario& s);

  uint64_t size() const { return sites_; }
  std::string Name(uint64_t site) const;
  // Whether `site` attacks (--attack, --attackers: exactly llround(fraction · N) do).
  bool Malicious(uint64_t site) const;
  uint64_t attackers() const;
  // The indices into the training set that `site` holds, ascending.
  std::vector<uint32_t> Examples(uint64_t site) const { return examples_.Of(site); }
  // `site`'s trainer: its examples (label-flipped if it attacks so), its
  // attack and its straggling.
  Result<std::unique_ptr<client::Trainer>> Site(uint64_t site) const;
  // Round `round`'s sites, ascending: --per-round's fixed count or
  // --sample-rate's Poisson draw.
  std::vector<uint64_t> Sample(uint64_t round) const;
  // Every site made now (loopback connects one agent per site).
  Result<Workload> Materialise() const;

 private:
  Population(const Scenario& s, SiteExamples examples) : scenario_(s), examples_(std::move(examples)) {}
  Scenario scenario_;
  SiteExamples examples_;
  uint64_t sites_ = 0;
  uint64_t seed_ = 0;
  int name_width_ = 3;
  Attack attack_;
  Stragglers stragglers_;
  std::shared_ptr<const models::Dataset> train_, flipped_;
};

}  // namespace estuary::simulations
