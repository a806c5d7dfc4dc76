// Site: a client site of several ranks (processes, one per CPU share or GPU)
// that is still one federated client: one connection, one update.
//
// Global rank 0 runs the Agent, and its Trainer is a SiteTrainer. When the
// Agent hands it a round, the SiteTrainer sends the round to every rank
// through the communicator — a fixed-size header and the task as bytes, then
// the global weights as floats, all broadcast from rank 0 — and every rank,
// rank 0 included, trains its share of the round with DataParallel (DDP or a
// ZeRO stage). Ranks other than 0 run RunFollower, which loops on those
// headers until rank 0 says the federation is over.
//
// A round on N ranks is the round one process would train, to fp32 rounding:
// every rank holds the site's whole data set and shuffles it with the same
// seed (task seed, round, client name) as ClassifierTrainer and TextTrainer,
// so all agree on the order; each global batch (the task's batch_size) is cut
// into N contiguous shares (ShareOfBatch), and rank r's gradient is weighted
// by n_r / n, so uneven splits stay exact. A rank whose share of a short last
// batch is empty still runs the step (one example at weight 0): the
// collectives of every rank must match. The reported loss is the sum of every
// rank's loss over its examples, agreed across ranks, over the examples of the
// last epoch — the same mean a single process reports.
//
// Between rounds rank 0 sends an idle header at least every third of the
// communicator's timeout (KeepAlive), so a follower waiting for the next
// round never mistakes a slow federation for a dead rank 0, and a dead
// follower is found even between rounds. Every collective is bounded by that
// timeout: a rank that dies makes every other rank fail, never hang.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "comm/communicator.h"
#include "parallel/data_parallel.h"
#include "client/rank_model.h"
#include "client/trainer.h"
#include "models/dataset.h"

namespace estuary::client {

// Rank r's contiguous share of a batch of n examples cut among `ranks`: the
// first n % ranks ranks take one example more.
struct BatchShare {
  uint64_t begin = 0;
  uint64_t count = 0;
};
BatchShare ShareOfBatch(uint64_t n, int ranks, int rank);

// One rank's half of a round: trains this rank's share of every global batch.
// Collective: every rank calls TrainRound with the same arguments.
class RankTrainer {
 public:
  virtual ~RankTrainer() = default;

  // The site's weight in the average (examples, or tokens); the same on every rank.
  virtual uint64_t num_examples() const = 0;
  // What rank 0 checks before it involves the other ranks: the task is one
  // this data trains and the global buffer matches the model's manifest.
  virtual Status Check(const TaskConfig& task, const Manifest& manifest, size_t global_size) = 0;
  // Trains from `global`; returns the mean training loss of the last epoch
  // (agreed across ranks). ReadOut must follow on every rank.
  virtual Result<double> TrainRound(std::span<const float> global, const TaskConfig& task, uint64_t round,
                                    std::string_view client_name) = 0;
  // Hands out the trained weights in buffer order, unit by unit (under ZeRO-3
  // each unit is gathered for the call and released after it), then ends the
  // round. Collective; fn may fail on one rank, the others still take part.
  // In a lora round the trained weights are the site's adapter.
  virtual Status ReadOut(const std::function<Status(uint64_t offset, std::span<const float> values)>& fn) = 0;

  // Rank 0, after TrainRound: how many values ReadOut hands out, and the
  // round's update from them (not collective). By default the trained
  // weights are the whole model and the update is their delta (FullUpdate).
  virtual size_t TrainedSize(const TaskConfig& task, size_t global_size) const;
  virtual Result<Update> UpdateOf(std::vector<float> trained, std::span<const float> global,
                                  const Manifest& manifest, const TaskConfig& task, double train_loss,
                                  std::chrono::steady_clock::time_point start, uint64_t round);
};

// The image models (MLP, CNN) with SGD: models::Model on the CPU, or what
// make_model makes (the GPU engine).
std::unique_ptr<RankTrainer> MakeClassifierRankTrainer(comm::Communicator& comm, std::shared_ptr<const models::Dataset> data,
                                                       parallel::DataParallelOptions options,
                                                       RankClassifierFactory make_model = MakeCpuRankClassifier);
// How a text site's ranks make their models: the decoder of full rounds,
// the adapted decoder of lora rounds (client/lora_round.h), and the site's
// adapter rank in a federation of mixed ranks (0: the federation's).
struct TextRankModels {
  RankDecoderFactory decoder = MakeCpuRankDecoder;
  RankLoraDecoderFactory lora_decoder = MakeCpuRankLoraDecoder;
  int lora_rank = 0;
  DType lora_base = DType::kF32;  // how the frozen base is kept (RankLoraDecoder::KeepBaseIn)
};
// The decoders with SGD or AdamW, as full or lora rounds: models::Llama and
// models::LoraLlama on the CPU, or what `models` makes (the GPU engines). A
// lora round under ZeRO-3 is refused by Check: the adapters open no unit to
// gather (it runs under DDP, ZeRO-1 and ZeRO-2).
std::unique_ptr<RankTrainer> MakeTextRankTrainer(comm::Communicator& comm, std::shared_ptr<const std::vector<int32_t>> tokens,
                                                 parallel::DataParallelOptions options, TextRankModels models = {});

// Rank 0's Trainer, driven by the Agent on its training thread. Train,
// KeepAlive, Finish and the update's stream must all run on that one thread
// (they share the communicator). Under ZeRO-3 the update streams
// (Update::stream): its slices are the deltas of one gathered unit at a time,
// so the trained model is never whole on rank 0; the other ranks take part
// in the gathers until the stream has run. A stream nobody ran is cancelled
// and run by the next Train or Finish, so the ranks never wait on it forever. When a collective fails, on_broken is called (on the training
// thread) before Train returns: the site cannot go on and should give up its
// connection; every later call fails at once.
class SiteTrainer : public Trainer {
 public:
  SiteTrainer(comm::Communicator& comm, std::unique_ptr<RankTrainer> rank, parallel::ZeroStage stage);

  uint64_t num_examples() const override { return rank_->num_examples(); }
  Result<Update> Train(std::span<const float> global, const Manifest& manifest, const TaskConfig& task,
                       uint64_t round, std::string_view client_name) override;

  // Tells the followers rank 0 is alive and no round is in progress.
  Status KeepAlive();
  // Tells the followers the federation is over: ok ends them with 0, an error
  // with its message. Later KeepAlives do nothing.
  Status Finish(const Status& outcome);

  std::function<void(const Status&)> on_broken;

 private:
  Status SendHeader(uint32_t kind, uint64_t length);
  Status Broken(Status status);
  void RunPending();

  comm::Communicator& comm_;
  std::unique_ptr<RankTrainer> rank_;
  Status broken_;
  bool finished_ = false;
  parallel::ZeroStage stage_;
  std::shared_ptr<UpdateStream> pending_;  // the last round's stream, until it has run
};

// Every rank but 0: follows rank 0's rounds until it says the federation is
// over. Returns ok when it ended well; an error when rank 0 gave up, a
// collective failed (a rank died) or this rank's training failed.
Status RunFollower(comm::Communicator& comm, RankTrainer& rank);

}  // namespace estuary::client
