// The Coordinator's evaluation rounds (coordinator.h; docs/EVALUATION.md).
//
// An evaluation round is its own round, after a committed one, rather than a
// field of the next training round's updates: the model after the last round
// must be evaluated too, when no training round follows; the sites asked
// are drawn apart from those training (evaluate_clients); and each answer is
// about exactly the model the round log names. The download is not wasted:
// a site that confirmed the version holds it, and a training round that
// selects it next sends it nothing.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>

#include "aggregation/sampling.h"
#include "server/coordinator.h"
#include "server/round_messages.h"

namespace estuary::server {

bool Coordinator::EvaluationDue(uint64_t round) const {
  return server::EvaluationDue(round, config_.evaluate_every, config_.rounds);
}

bool Coordinator::StartEvaluation(uint64_t round) {
  if (closing_) return false;
  std::vector<std::string> names;
  for (const auto& [name, session] : connected_) {
    if (evaluators_.count(name)) names.push_back(name);
  }
  if (names.empty()) {
    spdlog::warn("round {}: no connected site evaluates; federated evaluation skipped", round);
    return false;
  }
  const size_t k = config_.evaluate_clients > 0 ? aggregation::ClientsPerRound(config_.evaluate_clients, names.size())
                                                : names.size();
  const std::vector<std::string> selected =
      aggregation::SampleClients(names, k, EvaluationSeed(task_.seed()), round);
  // Assigned whole, not emplace()d: clang cannot default-construct a nested struct
  // with member initialisers until the enclosing class is complete.
  eval_ = EvalPhase{.round = round, .started = clock_.Now(), .sites = {}};
  distribution_.BeginRound(round);
  const int64_t deadline_ms = clock_.UnixMs() + int64_t(config_.round_deadline_s * 1000);
  v1::Envelope envelope = RoundStartMessage(round, distribution_.current(), manifest_, task_, deadline_ms);
  envelope.mutable_round_start()->set_evaluate_only(true);
  for (const auto& name : selected) {
    auto session = connected_.at(name);
    distribution_.Offer(session, envelope.mutable_round_start());
    session->Send(envelope);
    eval_->sites[name].session = session;
  }
  distribution_.StreamQueued();
  spdlog::info("round {} evaluation: {} of {} evaluating sites asked", round, selected.size(), names.size());
  eval_deadline_->Arm(std::chrono::milliseconds(int64_t(config_.round_deadline_s * 1000)), [this, round] {
    if (eval_ && eval_->round == round) MaybeFinishEvaluation(true);
  });
  return true;
}

void Coordinator::OnEvalReport(const std::shared_ptr<ClientSession>& session, const v1::EvalReport& report) {
  const std::string& name = session->name();
  if (!eval_ || report.round() != eval_->round) {
    // Late: its evaluation round closed at the deadline. Nothing to refuse.
    spdlog::info("round {} evaluation from {} came after its evaluation round closed", report.round(), name);
    return;
  }
  auto it = eval_->sites.find(name);
  if (it == eval_->sites.end()) {
    return Reject(session, v1::Error::NOT_SELECTED,
                  fmt::format("{} was not asked to evaluate round {}", name, eval_->round));
  }
  EvalSite& site = it->second;
  if (site.answered) {
    return Reject(session, v1::Error::DUPLICATE_UPDATE,
                  fmt::format("second evaluation of round {} from {}", eval_->round, name));
  }
  site.answered = true;
  SiteEvaluation& r = site.result;
  if (!report.supported()) {
    r.outcome = SiteEvaluation::Outcome::kUnsupported;
  } else {
    r.outcome = SiteEvaluation::Outcome::kEvaluated;
    r.examples = report.num_examples();
    r.loss = report.loss();
    if (report.has_accuracy()) r.accuracy = report.accuracy();
    const bool valid = r.examples > 0 && std::isfinite(r.loss) &&
                       (!r.accuracy || (*r.accuracy >= 0 && *r.accuracy <= 1));
    if (!valid) {
      r.outcome = SiteEvaluation::Outcome::kFailed;
      // One line, bounded: the detail is the peer's text.
      std::string detail = report.detail().substr(0, 512);
      std::replace(detail.begin(), detail.end(), '\n', ' ');
      spdlog::warn("round {} evaluation by {} failed: {}", eval_->round, name,
                   detail.empty() ? fmt::format("{} examples, loss {}, accuracy {}", r.examples, r.loss,
                                                r.accuracy ? fmt::format("{}", *r.accuracy) : "none")
                                  : detail);
    }
  }
  // It scored the model it downloaded, whose checksum it checked: it holds that version.
  distribution_.Confirm(name);
  MaybeFinishEvaluation(false);
}

void Coordinator::EvaluationGone(const std::string& name, const std::string& why) {
  if (!eval_) return;
  auto it = eval_->sites.find(name);
  if (it == eval_->sites.end() || it->second.answered) return;
  it->second.answered = true;
  it->second.result.outcome = SiteEvaluation::Outcome::kFailed;
  spdlog::info("round {} evaluation: {} will not answer: {}", eval_->round, name, why);
  MaybeFinishEvaluation(false);
}

void Coordinator::MaybeFinishEvaluation(bool deadline) {
  if (!eval_) return;
  std::vector<SiteEvaluation> results;
  for (const auto& [name, site] : eval_->sites) {
    if (!site.answered && !deadline) return;
    results.push_back(site.result);  // unanswered at the deadline: kFailed, its default
  }
  eval_deadline_->Cancel();
  const uint64_t round = eval_->round;
  const RoundEvaluation evaluation = AggregateEvaluations(results, SecondsSince(eval_->started));
  eval_.reset();
  LogIfError(store_.RecordEvaluation(round, evaluation), "store");
  if (events_ && evaluation.reported > 0) {  // serve --tensorboard: beside the round's own point
    std::map<std::string, double> scalars = {{"federated/loss", evaluation.loss},
                                             {"federated/examples", double(evaluation.examples)}};
    if (evaluation.accuracy) scalars["federated/accuracy"] = *evaluation.accuracy;
    LogIfError(events_->WriteScalars(int64_t(round), scalars), "tensorboard");
  }
  spdlog::info("round {} federated evaluation: accuracy {}, loss {:.4f} over {} examples of {} of {} sites ({} do "
               "not evaluate, {} failed)",
               round, evaluation.accuracy ? fmt::format("{:.4f}", *evaluation.accuracy) : "-", evaluation.loss,
               evaluation.examples, evaluation.reported, evaluation.selected, evaluation.unsupported,
               evaluation.failed);
  AfterRound();
}

}  // namespace estuary::server
