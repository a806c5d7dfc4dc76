#include "simulations/scenario_checks.h"

#include <cmath>

#include "aggregation/robust_strategy.h"
#include "aggregation/sampling.h"
#include "client/compute.h"
#include "models/language_model.h"
#include "simulations/attack.h"
#include "simulations/workload.h"

namespace estuary::simulations {

// --dp distributed needs secure aggregation, noise, and a fixed clip.
static Status CheckDistributedDp(const Scenario& s) {
  const v1::DpConfig& dp = s.federation.dp();
  if (s.dp != "central" && s.dp != "distributed") {
    return InvalidArgument("sim: --dp '{}': expected central or distributed", s.dp);
  }
  if (s.dp == "central") {
    if (s.secagg_options.dp.survivors != 1) {
      return InvalidArgument("sim: --dp-survivors calibrates the sites' noise shares: it needs --dp distributed");
    }
    return Status::Ok();
  }
  if (!s.secagg) {
    return InvalidArgument("sim: --dp distributed adds each site's noise inside secure aggregation: it needs --secagg");
  }
  if (!(dp.noise_multiplier() > 0)) return InvalidArgument("sim: --dp distributed needs --dp-noise-multiplier Z > 0");
  if (dp.adaptive_clip()) {
    return InvalidArgument("sim: --dp distributed with --dp-adaptive-clip: the clip's quantile needs a noised count of "
                           "unclipped sites, which secure aggregation does not compute yet");
  }
  if (!(s.secagg_options.dp.survivors > 0 && s.secagg_options.dp.survivors <= 1)) {
    return InvalidArgument("sim: --dp-survivors {}: must be in (0, 1]", s.secagg_options.dp.survivors);
  }
  return Status::Ok();
}

// --dropout: sampled sites leave synchronous rounds at a stage drawn from
// the seed and the round (dropout_draw.h), in either mode.
static Status CheckDropout(const Scenario& s) {
  if (!(s.dropout >= 0 && s.dropout < 1)) return InvalidArgument("sim: --dropout {}: must be in [0, 1)", s.dropout);
  if (s.dropout == 0) return Status::Ok();
  if (s.mode != "inproc" && (s.async || !s.server.empty())) {
    return InvalidArgument("sim: --dropout in loopback mode needs the simulator's own synchronous server (not --async "
                           "or --server): it waits for every dropped site to reconnect before sampling a round");
  }
  if (s.async && !s.secagg) {
    return InvalidArgument("sim: --dropout with --async: the draw is over a round's sampled sites, and FedBuff's "
                           "sites train without rounds (--stragglers makes some of them slow instead)");
  }
  return Status::Ok();
}

// What --secagg cannot be combined with: whatever needs one site's update.
static Status CheckSecAgg(const Scenario& s) {
  ESTUARY_RETURN_IF_ERROR(CheckDistributedDp(s));
  SecAggOptions o = s.secagg_options;
  o.dropout = s.dropout;
  if (!s.secagg) {
    if (o.neighbours || o.threshold) {
      return InvalidArgument("sim: --secagg-neighbours and --secagg-threshold need --secagg");
    }
    return Status::Ok();
  }
  if (s.clients > 0) {  // the graph for a round of the expected size
    const size_t per_round = s.sample_rate > 0 ? size_t(std::ceil(s.sample_rate * s.clients))
                                               : aggregation::ClientsPerRound(s.per_round, s.clients);
    ESTUARY_RETURN_IF_ERROR(CheckSecAggOptions(o, uint32_t(per_round)));
  }
  const std::string& strategy = s.federation.strategy().name();
  // A lora federation (naive, frozen-a) runs there as the server's rounds do,
  // and distributed DP as serve --secagg --dp distributed runs it; a server
  // the simulator attaches to (--server) runs what it was started with.
  if (s.mode != "inproc" && s.dp == "distributed" && !s.server.empty()) {
    return InvalidArgument("sim: --dp distributed with --server: the simulator configures only the server it starts; "
                           "one it attaches to noises as it was started (serve --secagg --dp distributed)");
  }
  if (aggregation::IsRobustStrategy(strategy)) {
    return InvalidArgument("sim: --secagg with --strategy {}: a robust rule needs the individual updates, which "
                           "secure aggregation hides (fedavg, fedavgm and the fedopt family take the sum)",
                           strategy);
  }
  if (strategy == "fednova") {
    return InvalidArgument("sim: --secagg with --strategy fednova: FedNova divides each site's update by its own "
                           "local work, which a masked sum cannot");
  }
  if (s.task().update_kind() == v1::UPDATE_LORA && s.task().lora().merge() == "exact") {
    return InvalidArgument("sim: --secagg with --lora-merge exact: the exact merge needs each site's factors B_i, A_i "
                           "(their products), which secure aggregation hides; naive and frozen-a take the sum");
  }
  if (s.federation.dp().noise_multiplier() > 0 && s.dp == "central") {
    return InvalidArgument("sim: --secagg with --dp central: DP-FedAvg clips and counts individual updates on the "
                           "server, which secure aggregation hides (--dp distributed noises them on the sites)");
  }
  if (s.federation.limits().max_norm() > 0 || s.federation.limits().max_norm_over_median() > 0) {
    return InvalidArgument("sim: --secagg with --max-update-norm or --max-norm-over-median: the server never sees an "
                           "update's norm; --secagg-clip bounds it on the site");
  }
  if (!s.attack.empty()) {
    return InvalidArgument("sim: --secagg with --attack: the attacks and their refusals act on individual updates");
  }
  return Status::Ok();
}


// Poisson sampling (under DP the mean divides by q · N): in process, or by
// the server loopback starts (serve --sample-rate, loopback.cc); not by one
// it attaches to, which samples as it was started.
static Status CheckSampleRate(const Scenario& s) {
  if (s.sample_rate == 0) return Status::Ok();
  if (!(s.sample_rate > 0 && s.sample_rate <= 1)) {
    return InvalidArgument("sim: --sample-rate {}: must be in (0, 1]", s.sample_rate);
  }
  if (s.mode != "inproc" && !s.server.empty()) {
    return InvalidArgument("sim: --sample-rate with --server: the simulator configures only the server it starts; "
                           "one it attaches to samples as it was started (serve --sample-rate Q --total-sites N)");
  }
  return Status::Ok();
}

// Loopback connects one agent, with its own certificate and TLS connection,
// per site of the population (the server samples among those connected), so
// a population it runs must fit one process's connections: one server holds
// ten thousand (bench/connections, docs/PERFORMANCE.md).
constexpr uint32_t kLoopbackMaxPopulation = 10000;

// --examples-per-client: image sites only, and in loopback a population one process can connect.
static Status CheckPopulation(const Scenario& s) {
  if (s.examples_per_client == 0) return Status::Ok();
  if (models::IsLanguageModel(s.task().model())) {
    return InvalidArgument("sim: --examples-per-client draws image examples; {}'s sites hold a topic or instruction "
                           "rows each, not a sample of a training set",
                           s.task().model());
  }
  if (s.mode == "loopback" && s.clients > kLoopbackMaxPopulation) {
    return InvalidArgument("sim: --mode loopback connects one agent (a certificate and a TLS connection) per site: {} "
                           "sites is over its {}; --mode inproc makes only the sites a round samples",
                           s.clients, kLoopbackMaxPopulation);
  }
  return Status::Ok();
}

Status CheckScenario(const Scenario& s) {
  if (s.task().max_local_seconds() > 0) {
    // Steps cut by the clock would differ from run to run and machine to machine.
    return InvalidArgument("sim: --max-local-seconds {}: a simulation stays reproducible from its seed, and a cap on "
                           "wall time would not; --stragglers makes sites do partial work by a seeded draw",
                           s.task().max_local_seconds());
  }
  ESTUARY_RETURN_IF_ERROR(CheckPopulation(s));
  ESTUARY_RETURN_IF_ERROR(CheckSampleRate(s));
  ESTUARY_RETURN_IF_ERROR(CheckDropout(s));
  ESTUARY_RETURN_IF_ERROR(CheckSecAgg(s));
  if (s.clients == 0 && (s.partition_by.empty() || !InstructionData(s))) {
    return InvalidArgument("sim: --clients must be >= 1");
  }
  if (!(s.evaluate_clients >= 0) || !std::isfinite(s.evaluate_clients)) {
    return InvalidArgument("sim: --evaluate-clients {}: must be >= 0 (0: every site)", s.evaluate_clients);
  }
  if (s.evaluate_every > 0 && (s.async || s.examples_per_client > 0)) {
    return InvalidArgument("sim: --evaluate-every with {}: federated evaluation runs in synchronous rounds of sites "
                           "built up front, for now",
                           s.async ? "--async" : "--examples-per-client");
  }
  if (s.evaluate_every > 0 && !(s.eval_split > 0 && s.eval_split < 1)) {
    return InvalidArgument("sim: --eval-split {}: with --evaluate-every, must be in (0, 1)", s.eval_split);
  }
  if (InstructionData(s) && !models::IsLanguageModel(s.task().model())) {
    return InvalidArgument("sim: --data {}: instruction data trains a language model (--model llama-*), not '{}'",
                           s.data_dir.string(), s.task().model());
  }
  if (!s.federation.initial_model().empty()) {
    // Its sites are the user's own programs (include/estuary/client.h); the simulator has no trainer for it.
    return InvalidArgument("sim: --initial-model {}: the simulator trains the built-in models; a model known only as "
                           "a file trains at sites written against the client API (estuary-server serve)",
                           s.federation.initial_model());
  }
  if (!(s.per_round > 0)) return InvalidArgument("sim: --per-round {} must be > 0", s.per_round);
  if (s.rounds == 0) return InvalidArgument("sim: --rounds must be >= 1");
  if (s.threads == 0) return InvalidArgument("sim: --threads must be >= 1");
  if (s.federation.strategy().name() == "scaffold") {
    if (!s.attack.empty()) return InvalidArgument("sim: --strategy scaffold with --attack: attackers send no Δc");
    if (s.secagg) return InvalidArgument("sim: --strategy scaffold with --secagg: Δc is not masked");
  }
  ESTUARY_RETURN_IF_ERROR(client::ParseCompute(s.device, s.precision).status());
  ESTUARY_RETURN_IF_ERROR(ParseAttack(s.attack).status());
  if (!(s.attackers >= 0 && s.attackers <= 1)) {
    return InvalidArgument("sim: --attackers {}: must be a fraction in [0, 1]", s.attackers);
  }
  if (s.attack.empty() != (s.attackers == 0)) {
    return InvalidArgument("sim: --attack and --attackers go together (got --attack '{}', --attackers {})", s.attack,
                           s.attackers);
  }
  if (s.attack == "label-flip" && models::IsLanguageModel(s.task().model())) {
    return InvalidArgument("sim: --attack label-flip flips image classes; {} trains on text", s.task().model());
  }
  if (!s.attack.empty() && s.task().update_kind() == v1::UPDATE_LORA) {
    return InvalidArgument("sim: --attack replaces full deltas; a lora federation's sites upload adapter factors");
  }
  if (s.task().update_kind() == v1::UPDATE_LORA) {
    ESTUARY_RETURN_IF_ERROR(SiteRanks(s).status());
    if (s.lora_base_dtype != "f32" && s.lora_base_dtype != "bf16") {
      return InvalidArgument("sim: --lora-base-dtype '{}': expected f32 or bf16", s.lora_base_dtype);
    }
    if (!s.lora_site_ranks.empty() && s.task().lora().merge() != "exact") {
      return InvalidArgument("sim: --lora-site-ranks needs --lora-merge exact (only exact merges mixed ranks), not {}",
                             s.task().lora().merge());
    }
  }
  return aggregation::CheckFederation(FederationOf(s));
}

}  // namespace estuary::simulations
