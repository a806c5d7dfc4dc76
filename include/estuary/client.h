// Estuary's client API: a site that trains your own model.
//
// Implement estuary::Trainer and hand it to estuary::RunSite. RunSite
// connects to the federation's server over mutual TLS, and for every round
// this site is chosen for it receives the global model, calls Train on a
// thread of its own (the connection keeps its heartbeats meanwhile), streams
// the update back and reconnects after a dropped connection, until the
// server says the federation is complete. Nothing else of Estuary is needed
// to build a site: this header holds the whole contract, with only standard
// C++ types.
//
// The model is a list of named fp32 tensors, the server's global model in
// its order. A federation started with `estuary-server serve
// --initial-model FILE.safetensors` sends the file's F32, BF16 and F16
// tensors, all widened exactly to fp32 (cast them back to your parameters'
// dtype); integer buffers such as BatchNorm's num_batches_tracked stay at the
// site (the server exports them as the file had them), and a 0-d tensor comes
// as shape [1]. Its TaskInfo::model is "custom@" and 12 hex digits of a
// SHA-256 of the file's layout: ModelName of your own tensors gives the same
// string, and with SiteOptions::expected_model set a site refuses, in one
// line, a federation of any other model.
//
// A Trainer may also score the global model on held-out examples of its own
// (Trainer::Evaluate) for the server's federated evaluation. Adding it to
// an existing Trainer is optional; a site written before it builds as it
// is, against this header (rebuild it: the library's Trainer has one more
// virtual function than a site compiled against an older header knows of).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

// What the shared library exports; the rest of it stays inside.
#if defined(__GNUC__)
#define ESTUARY_API __attribute__((visibility("default")))
#else
#define ESTUARY_API
#endif

namespace estuary {

struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;  // row-major, as many as the shape's elements
};

// What the server asks of this round, as every chosen site receives it.
struct TaskInfo {
  std::string model;  // "custom@0123456789ab", or a built-in model's name
  uint64_t round = 0;
  std::string site;   // this site's name (its certificate's common name)
  uint32_t epochs = 0;
  uint32_t batch_size = 0;
  float learning_rate = 0;
  float momentum = 0;
  float weight_decay = 0;
  std::string optimizer;      // "sgd" or "adamw": a suggestion to a custom trainer
  uint32_t max_local_steps = 0;  // 0: no limit
  // A cap on this round's local training time, in seconds (0: none): stop
  // after the step that crosses it and report the steps taken (local_steps).
  double max_local_seconds = 0;
  float proximal_mu = 0;      // FedProx: mu / 2 * |w - w_global|^2 added to the local objective
  uint64_t seed = 0;          // the federation's; combine it with round and site to shuffle
};

struct TrainResult {
  // Every tensor of the global model, by name, in any order: the weights
  // after local training, or (with is_delta) local minus global.
  std::vector<Tensor> tensors;
  bool is_delta = false;
  // This update's weight in the average: the examples it trained on (> 0).
  uint64_t num_examples = 0;
  // Reported to the server's round log: "loss" as the site's training loss
  // (a loss that is not finite withholds the update: the site diverged).
  // Other names are logged by this site only.
  std::map<std::string, double> metrics;
  // The optimizer steps this round took (0: not reported). FedNova weighs
  // each update by them, so a site that did less work (max_local_seconds,
  // a smaller share) counts for what it did; it refuses updates without.
  uint64_t local_steps = 0;
};

// A site's score of the global model on its own held-out examples, for the
// server's federated evaluation (estuary-server serve --evaluate-every).
struct EvalResult {
  // false: this site does not evaluate (the default Trainer::Evaluate's
  // answer); the server counts it apart, and it weighs nothing.
  bool supported = false;
  // The held-out examples scored (> 0 when supported): the weight of this
  // site's loss and accuracy in the federation's means. They should be
  // examples Train never trains on.
  uint64_t num_examples = 0;
  double loss = 0;            // mean over those examples
  bool has_accuracy = false;  // the model has an accuracy
  double accuracy = 0;        // in [0, 1], with has_accuracy
};

class ESTUARY_API Trainer {
 public:
  virtual ~Trainer() = default;
  // The examples this site holds, announced to the server when it connects.
  virtual uint64_t num_examples() const = 0;
  // Trains from `global` on the site's own data. Called on a thread of its
  // own, one round at a time. Throwing (any std::exception) withholds this
  // round's update: the error is logged and the site waits for the next.
  virtual TrainResult Train(const std::vector<Tensor>& global, const TaskInfo& task) = 0;
  // Scores `global` (every tensor of the global model, as Train receives
  // them) on the site's held-out examples, when the server runs an
  // evaluation round; on the same thread as Train, never at once with it.
  // Optional: by default the site answers that it does not evaluate.
  // Throwing (any std::exception) reports a failed evaluation; neither
  // holds up the federation.
  virtual EvalResult Evaluate(const std::vector<Tensor>& /*global*/, const TaskInfo& /*task*/) { return {}; }
};

struct SiteOptions {
  std::string server = "127.0.0.1:7443";  // HOST:PORT
  // PEM files issued by the federation's CA (estuary-server certs).
  std::string ca;    // the federation CA's certificate
  std::string cert;  // this site's certificate chain
  std::string key;   // its private key
  std::string crl;   // optional: the CA's revocation list
  // Empty: train whatever the server sends. Otherwise the model name this
  // site trains (ModelName of its tensors): a round of another is refused.
  std::string expected_model;
  double max_backoff_s = 30;  // reconnects back off exponentially up to this
};

struct SiteResult {
  bool ok = false;
  std::string error;          // one line when !ok: why the site gave up
  uint64_t rounds_trained = 0;
};

// Runs the site until the federation completes (ok) or the site gives up:
// bad TLS files, a server whose certificate fails the check, a refused
// model. Blocks; call it from your main thread.
ESTUARY_API SiteResult RunSite(const SiteOptions& options, Trainer& trainer);

// One tensor of a model as its safetensors file describes it: the dtype as
// safetensors spells it ("F32", "BF16", "F16", "I64", ...).
struct TensorLayout {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;
};
// The name a federation gives a model of these tensors, integer buffers
// included, in any order: "custom@" + 12 hex digits.
ESTUARY_API std::string ModelName(const std::vector<TensorLayout>& tensors);

}  // namespace estuary
