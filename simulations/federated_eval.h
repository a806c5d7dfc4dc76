// Federated evaluation in the in-process simulator: the sites the server
// would ask score the round's global model on their held-out examples
// (client::Trainer::Evaluate), and their answers are folded as the server
// folds them (server::AggregateEvaluations), into the round's report.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/manifest.h"
#include "base/status.h"
#include "client/trainer.h"
#include "estuary.pb.h"
#include "server/store.h"
#include "simulations/report.h"

namespace estuary::simulations {

// Samples as the server does (every site evaluates in a simulation): all of
// `names` with evaluate_clients 0, else that count or fraction, drawn with
// server::EvaluationSeed; runs their Evaluate on up to `threads` threads. A
// site whose evaluation fails counts as failed, as on the server.
server::RoundEvaluation EvaluateOnSites(const std::vector<std::string>& names,
                                        const std::vector<std::unique_ptr<client::Trainer>>& trainers,
                                        double evaluate_clients, std::span<const float> global,
                                        const Manifest& manifest, const v1::TaskConfig& task, uint64_t round,
                                        uint32_t threads);

// The round's federated_* fields from `evaluation` (accuracy and loss only
// when some site reported).
void SetFederated(RoundReport& row, const server::RoundEvaluation& evaluation);

}  // namespace estuary::simulations
