// The clients of a simulated federation: their names and trainers, made
// from the scenario's data (MNIST images split by --partition, one fortunes
// topic a site, or instruction JSONL by a field or by Dirichlet), each a site
// of one process (client::MakeLocalSite) on the scenario's device.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "client/site.h"
#include "client/trainer.h"
#include "models/lm_sequences.h"
#include "simulations/attack.h"
#include "simulations/runner.h"

namespace estuary::simulations {

// What a simulation trains: the clients' trainers (by name) and, for
// instruction data, the held-out rows the server side scores.
struct Workload {
  std::vector<std::string> names;
  std::vector<std::unique_ptr<client::Trainer>> trainers;  // trainers[i] is names[i]'s
  std::shared_ptr<const models::TokenRows> held_out;        // instruction data: what the evaluator scores
  std::string held_out_jsonl;                               // the same examples as lines of the file
};

// The clients: their names and trainers, from the scenario's data (with
// --examples-per-client, every site of its population; population.h).
Result<Workload> ClientsOf(const Scenario& s);
// How every simulated site runs: one process on the scenario's device, its
// models shared with the other sites its thread trains.
Result<client::LocalSiteOptions> SiteOptionsOf(const Scenario& s);
// `honest`, uploading what `attack` makes of its delta (its noise drawn from
// the seed, the round and `site`).
std::unique_ptr<client::Trainer> MakeAttacker(std::unique_ptr<client::Trainer> honest, const Attack& attack,
                                              uint64_t seed, uint32_t site);
// Whether --data is instruction JSONL (else an IDX or fortunes directory).
bool InstructionData(const Scenario& s);
// --lora-site-ranks as numbers; empty when not given.
Result<std::vector<int>> SiteRanks(const Scenario& s);

}  // namespace estuary::simulations
