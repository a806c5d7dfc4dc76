#include "simulations/federated_eval.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>

#include "aggregation/sampling.h"
#include "base/parallel_for.h"
#include "server/evaluation.h"

namespace estuary::simulations {

server::RoundEvaluation EvaluateOnSites(const std::vector<std::string>& names,
                                        const std::vector<std::unique_ptr<client::Trainer>>& trainers,
                                        double evaluate_clients, std::span<const float> global,
                                        const Manifest& manifest, const v1::TaskConfig& task, uint64_t round,
                                        uint32_t threads) {
  const auto start = std::chrono::steady_clock::now();
  const size_t k = evaluate_clients > 0 ? aggregation::ClientsPerRound(evaluate_clients, names.size()) : names.size();
  const std::vector<std::string> selected =
      aggregation::SampleClients(names, k, server::EvaluationSeed(task.seed()), round);
  std::vector<server::SiteEvaluation> results(selected.size());
  ParallelFor(selected.size(), threads, [&](size_t i) {
    const size_t site = size_t(std::find(names.begin(), names.end(), selected[i]) - names.begin());
    Result<client::Evaluation> e = trainers[site]->Evaluate(global, manifest, task, round, selected[i]);
    server::SiteEvaluation& r = results[i];
    if (!e.ok()) {
      spdlog::warn("round {} evaluation by {} failed: {}", round, selected[i], e.status().ToString());
      r.outcome = server::SiteEvaluation::Outcome::kFailed;
    } else if (!e->supported) {
      r.outcome = server::SiteEvaluation::Outcome::kUnsupported;
    } else {
      r = {.outcome = server::SiteEvaluation::Outcome::kEvaluated,
           .examples = e->examples,
           .loss = e->loss,
           .accuracy = e->accuracy};
    }
  });
  return server::AggregateEvaluations(
      results, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

void SetFederated(RoundReport& row, const server::RoundEvaluation& evaluation) {
  row.federated_examples = evaluation.examples;
  if (evaluation.reported > 0) row.federated_loss = evaluation.loss;
  row.federated_accuracy = evaluation.accuracy;
}

}  // namespace estuary::simulations
