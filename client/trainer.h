// Trainer: one site's local training, the same code inside estuary-client and
// the in-process simulator.
//
// Given the global weights (a flat buffer and its manifest) and the round's
// task as the server sent it, it trains a model on the site's own examples and
// returns the update: delta = local - global over the same flat layout (or,
// in a lora federation, the site's adapter). Shuffling is seeded by (task
// seed, round, client name), so a rerun produces the same bits.
//
// There is one implementation, client/site.h's SiteTrainer: a site of N ranks,
// N >= 1; a site of one process is its one-rank case.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "base/manifest.h"
#include "base/status.h"
#include "client/task.h"
#include "client/update_stream.h"
#include "estuary.pb.h"

namespace estuary::client {

struct Update {
  UpdateKind kind = UpdateKind::kFull;
  uint64_t num_examples = 0;
  double train_loss = 0;     // mean loss over the last local epoch
  double seconds = 0;        // wall time of local training
  // The optimizer steps the round took (τ), and FedNova's ‖a‖₁ for them
  // (client/local_work.h); both travel in UpdateBegin.
  uint64_t local_steps = 0;
  double normalizer = 0;
  // Where the round trained, as the site ran it: "cuda::LlamaEngine on
  // cuda:0 in bf16, 1 rank (solo, ddp)" (SiteTrainer says how).
  std::string trained_on;
  Manifest manifest;
  std::vector<float> payload;
  // SCAFFOLD (client/scaffold.h): Δc_i, of payload's size; empty otherwise.
  std::vector<float> control_delta;
  // Set instead of payload when the delta streams slice by slice
  // (update_stream.h): a ZeRO-3 site. Whoever receives the update must Run
  // it on the trainer's thread, or Cancel and Run it.
  std::shared_ptr<UpdateStream> stream;
};

// A site's score of a global model on its own held-out examples (federated
// evaluation, docs/EVALUATION.md). supported false: the site does not
// evaluate (no held-out data, or no evaluator for the model).
struct Evaluation {
  bool supported = false;
  uint64_t examples = 0;
  double loss = 0;                 // mean over the examples
  std::optional<double> accuracy;  // when the model has one
  double seconds = 0;
};

class Trainer {
 public:
  virtual ~Trainer() = default;

  // The weight of this site's update in the average (examples, or tokens).
  virtual uint64_t num_examples() const = 0;

  // Fails if the task is out of range (client/task.h), names a model this
  // trainer's data cannot train, the global buffer does not match that
  // model's manifest, or asks for an update kind this trainer cannot produce.
  virtual Result<Update> Train(std::span<const float> global, const Manifest& manifest, const v1::TaskConfig& task,
                               uint64_t round, std::string_view client_name) = 0;

  // SCAFFOLD (client/scaffold.h): Train with every local gradient corrected
  // by (control - site_control), both of global's size. By default refused:
  // a trainer that cannot correct its gradients says so.
  virtual Result<Update> TrainControlled(std::span<const float> global, const Manifest& manifest,
                                         const v1::TaskConfig& task, uint64_t round, std::string_view client_name,
                                         std::span<const float> control, std::span<const float> site_control) {
    return FailedPrecondition("trainer: this site cannot correct its gradients by SCAFFOLD's control variates");
  }

  // Scores `global` on the site's held-out examples, on the training thread
  // like Train. By default the site does not evaluate (supported false); an
  // error is an evaluation that failed, reported as such.
  virtual Result<Evaluation> Evaluate(std::span<const float> global, const Manifest& manifest,
                                      const v1::TaskConfig& task, uint64_t round, std::string_view client_name) {
    return Evaluation{};
  }
};

// An update's header (kind, weight, loss), or an error when the loss is not
// finite: the site diverged, and nothing of it should reach the average.
Result<Update> TrainedUpdate(UpdateKind kind, uint64_t num_examples, double train_loss, uint64_t round);

// The full update of a local training that started at `start` from `global`
// and ended at `local`: delta = local - global, in place. Fails if the loss
// is not finite (the site diverged: nothing of it should reach the average).
Result<Update> FullUpdate(std::vector<float> local, std::span<const float> global, const Manifest& manifest,
                          uint64_t num_examples, double train_loss, std::chrono::steady_clock::time_point start,
                          uint64_t round);

}  // namespace estuary::client
