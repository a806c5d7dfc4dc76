// The Coordinator's differential privacy and sampling (docs/PRIVACY.md): who
// takes part in a round — a fixed number of the connected sites, or each
// with probability q (Poisson sampling) — and what a round spends: the
// accountant's preview before it opens (the budget stop) and its ε when it
// commits, for central DP (DP-FedAvg) and for distributed DP under SecAgg+.
// On the Coordinator's strand, like the rest of the round.
#include <spdlog/spdlog.h>

#include <cmath>

#include "aggregation/sampling.h"
#include "server/coordinator.h"
#include "server/recover.h"
#include "server/round_messages.h"

namespace estuary::server {

bool Coordinator::DrawSites(const std::vector<std::string>& names, std::vector<std::string>* selected) {
  if (config_.sample_rate <= 0) {
    // A retry mixes in its count: the same seed would draw the sites that just failed the round.
    const uint64_t seed = failed_tries_ == 0 ? task_.seed() : MixSeed(task_.seed(), failed_tries_);
    const size_t k = aggregation::ClientsPerRound(config_.clients_per_round, names.size());
    *selected = aggregation::SampleClients(names, k, seed, round_);
    return true;
  }
  // Poisson sampling: each connected site joins with probability q, by the
  // server's CSPRNG unless the operator seeded it (tests).
  const uint64_t seed = failed_tries_ == 0 ? config_.sample_seed : MixSeed(config_.sample_seed, failed_tries_);
  auto drawn = config_.sample_seed != 0
                   ? aggregation::PoissonSampleClients(names, config_.sample_rate, seed, round_)
                   : aggregation::PoissonSampleClientsUnpredictably(names, config_.sample_rate);
  if (!drawn.ok()) {
    spdlog::critical("round {}: {}", round_, drawn.status().ToString());
    return false;
  }
  const size_t needed = config_.secagg.on ? 2 : 1;
  if (drawn->size() < needed) {
    // Nothing is released, so nothing is spent; a seeded draw mixes in the try.
    spdlog::warn("round {}: Poisson sampling at q = {:g} drew {} of {} connected sites, fewer than a round needs "
                 "({}); drawing again",
                 round_, config_.sample_rate, drawn->size(), names.size(), needed);
    ++failed_tries_;
    retry_->Arm(std::chrono::seconds(1), [this] { MaybeStartRound(); });
    return false;
  }
  *selected = std::move(*drawn);
  return true;
}

Status Coordinator::RecordPrivacy(const Aggregator::Finished& result, std::vector<double>* distributed_rdp) {
  const v1::DpConfig& dp = config_.federation.dp();
  if (accountant_ && result.dp) {
    ESTUARY_ASSIGN_OR_RETURN(const privacy::Epsilon spent,
                             accountant_->EpsilonAfter(round_sampling_rate_, dp.noise_multiplier()));
    record_.privacy = RoundPrivacy{.sampling_rate = round_sampling_rate_,
                                   .noise_multiplier = dp.noise_multiplier(),
                                   .clip = result.dp->clip,
                                   .noise_stddev = result.dp->noise_stddev,
                                   .epsilon = spent.epsilon,
                                   .delta = accountant_->delta()};
  } else if (accountant_ && secagg_ && secagg_->dp) {
    // Charged with the shares the unmasked sum actually held.
    const privacy::DistributedDpPlan& plan = *secagg_->dp;
    ESTUARY_ASSIGN_OR_RETURN(*distributed_rdp, privacy::DistributedDpRoundRdp(plan, secagg_->included,
                                                                              round_sampling_rate_,
                                                                              accountant_->orders()));
    ESTUARY_ASSIGN_OR_RETURN(const privacy::Epsilon spent, accountant_->EpsilonAfterRdp(*distributed_rdp));
    record_.privacy = RoundPrivacy{
        .sampling_rate = round_sampling_rate_,
        .noise_multiplier = dp.noise_multiplier(),
        .clip = dp.clip(),
        // On the sum, in the model's units, as DP-FedAvg's: the shares summed, over the scale.
        .noise_stddev = std::sqrt(double(secagg_->included) * double(plan.site_variance)) / plan.scale,
        .epsilon = spent.epsilon,
        .delta = accountant_->delta()};
  }
  return Status::Ok();
}

bool Coordinator::WithinPrivacyBudget(size_t selected, size_t population) {
  if (!accountant_) return true;
  // Poisson sampling: q is the probability each site joined with, the accountant's own assumption.
  round_sampling_rate_ = config_.sample_rate > 0 ? config_.sample_rate
                         : population > 0        ? double(selected) / double(population)
                                                 : 0;
  const v1::DpConfig& dp = config_.federation.dp();
  if (dp.max_epsilon() <= 0) return true;
  Result<privacy::Epsilon> next = privacy::Epsilon{};
  if (config_.distributed_dp()) {
    // As if only the fewest inputs the server may unmask were summed.
    const uint64_t dimension =
        lora_ ? aggregation::ExpectedLoraUpload(*lora_).total_elements : manifest_.total_elements;
    auto plan = DistributedDpPlanFor(config_, uint32_t(selected), dimension);
    auto rdp = plan.ok() ? privacy::DistributedDpRoundRdp(*plan, plan->min_included, round_sampling_rate_,
                                                          accountant_->orders())
                         : Result<std::vector<double>>(plan.status());
    next = rdp.ok() ? accountant_->EpsilonAfterRdp(*rdp) : Result<privacy::Epsilon>(rdp.status());
  } else {
    next = accountant_->EpsilonAfter(round_sampling_rate_, dp.noise_multiplier());
  }
  if (next.ok() && next->epsilon <= dp.max_epsilon()) return true;
  spdlog::warn("federation stops before round {}: ε would reach {} at δ {:g}, beyond dp_max_epsilon {:g} "
               "(ε {:.4g} after {} rounds)",
               round_, next.ok() ? fmt::format("{:.4g}", next->epsilon) : next.status().ToString(), dp.delta(),
               dp.max_epsilon(), accountant_->Spent().epsilon, accountant_->rounds());
  budget_spent_ = true;
  LogIfError(store_.SetMeta("complete", std::to_string(round_ - 1)), "store");
  SendToAll(connected_, FederationCompleteMessage(round_ - 1, distribution_.current()));
  if (on_complete_) on_complete_();
  return false;
}

}  // namespace estuary::server
