// The Agent's hand-off of a received model to the site's trainer (agent.h):
// train it, or, in an evaluation round (RoundStart.evaluate_only), score it
// on the site's held-out examples and answer with an EvalReport. Both run on
// the training executor, one at a time; a round that arrives meanwhile waits
// for the one running and then replaces it.
#include <spdlog/spdlog.h>

#include "client/agent.h"

namespace estuary::client {

namespace asio = boost::asio;

void Agent::Train() {
  if (busy_training_) {  // a newer round arrived while the last one trains
    train_again_ = true;
    return;
  }
  busy_training_ = true;
  const uint64_t round = round_->round();
  auto model = model_;
  auto task = round_->task();
  auto manifest = manifest_;
  if (round_->evaluate_only()) {
    asio::post(training_, [self = shared_from_this(), model, task, manifest, round] {
      const auto start = std::chrono::steady_clock::now();
      Result<Evaluation> evaluation = self->trainer_.Evaluate(*model, manifest, task, round, self->name_);
      if (evaluation.ok() && evaluation->seconds == 0) {
        evaluation->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
      asio::post(self->io_, [self, round, evaluation = std::move(evaluation)]() mutable {
        self->OnEvaluated(round, std::move(evaluation));
      });
    });
    return;
  }
  // SCAFFOLD: the round's c came after the model; the site's c_i corrects with it.
  auto control = round_->control_follows() ? control_ : nullptr;
  asio::post(training_, [self = shared_from_this(), model, task, manifest, round, control] {
    spdlog::debug("{}: round {} training starts", self->name_, round);
    Result<Update> update =
        control ? self->options_.scaffold->Train(self->trainer_, *model, manifest, task, round, self->name_, *control)
                : self->trainer_.Train(*model, manifest, task, round, self->name_);
    asio::post(self->io_, [self, round, update = std::move(update)]() mutable { self->OnTrained(round, std::move(update)); });
  });
}

void Agent::OnEvaluated(uint64_t round, Result<Evaluation> evaluation) {
  busy_training_ = false;
  if (train_again_) {
    train_again_ = false;
    return Train();
  }
  // An answer for an evaluation round announced on an earlier connection is
  // stale: the server closed that round when the connection dropped.
  if (stopped_ || !round_ || round_->round() != round || !round_->evaluate_only() || round_connection_ != connection_) {
    return;
  }
  round_.reset();
  if (!options_.keep_model) {
    model_.reset();
    model_version_ = 0;
    model_checksum_.clear();
  }
  v1::Envelope envelope;
  v1::EvalReport* report = envelope.mutable_eval_report();
  report->set_round(round);
  if (!evaluation.ok()) {
    spdlog::error("{}: round {} evaluation: {}", name_, round, evaluation.status().ToString());
    report->set_supported(true);
    report->set_detail(evaluation.status().ToString());
  } else if (!evaluation->supported) {
    spdlog::info("{}: round {}: this site does not evaluate", name_, round);
  } else {
    report->set_supported(true);
    report->set_num_examples(evaluation->examples);
    report->set_loss(evaluation->loss);
    report->set_has_accuracy(evaluation->accuracy.has_value());
    if (evaluation->accuracy) report->set_accuracy(*evaluation->accuracy);
    report->set_seconds(evaluation->seconds);
    spdlog::info("{}: round {} evaluated on {} held-out examples: loss {:.4f}{} ({:.3f} s)", name_, round,
                 evaluation->examples, evaluation->loss,
                 evaluation->accuracy ? fmt::format(", accuracy {:.4f}", *evaluation->accuracy) : std::string(),
                 evaluation->seconds);
  }
  Send(envelope);
}

}  // namespace estuary::client
