// Site: a client site of N ranks (processes, one per CPU share or GPU; N >= 1)
// that is one federated client: one connection, one update.
//
// Global rank 0 runs the Agent, and its Trainer is a SiteTrainer. When the
// Agent hands it a round, the SiteTrainer checks the task, sends the round to
// every other rank through the communicator — a fixed-size header, the round
// as a v1::SiteRound message (the task as the server sent it), then the
// global weights as floats, all broadcast from rank 0 — and every rank, rank 0
// included, trains its share of the round (client/rank_trainer.h). Ranks other
// than 0 run RunFollower, which loops on those headers until rank 0 says the
// federation is over. A site of one process is the same SiteTrainer over a
// solo communicator (MakeLocalSite): every check and message is written once.
//
// Between rounds rank 0 sends an idle header at least every third of the
// communicator's timeout (KeepAlive), so a follower waiting for the next
// round never mistakes a slow federation for a dead rank 0, and a dead
// follower is found even between rounds. Every collective is bounded by that
// timeout: a rank that dies makes every other rank fail, never hang.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "client/compute.h"
#include "models/instruction_set.h"
#include "client/rank_trainer.h"
#include "client/trainer.h"
#include "comm/communicator.h"
#include "models/dataset.h"
#include "parallel/data_parallel.h"

namespace estuary::client {

// Rank 0's Trainer, driven by the Agent on its training thread. Train,
// KeepAlive, Finish and the update's stream must all run on that one thread
// (they share the communicator). Under ZeRO-3 the update streams
// (Update::stream): its slices are the deltas of one gathered unit at a time,
// so the trained model is never whole on rank 0; the other ranks take part
// in the gathers until the stream has run. A stream nobody ran is cancelled
// and run by the next Train or Finish, so the ranks never wait on it forever.
// When a collective fails, on_broken is called (on the training thread)
// before Train returns: the site cannot go on and should give up its
// connection; every later call fails at once.
class SiteTrainer : public Trainer {
 public:
  // `rank` trains over `comm`, which outlives this trainer; `compute` is
  // where rank 0 trains, for the report of where a round ran.
  SiteTrainer(comm::Communicator& comm, std::unique_ptr<RankTrainer> rank, parallel::ZeroStage stage,
              Compute compute);
  // A site of one process: owns its solo communicator.
  SiteTrainer(std::unique_ptr<comm::Communicator> solo, std::unique_ptr<RankTrainer> rank,
              parallel::ZeroStage stage, Compute compute);

  uint64_t num_examples() const override { return rank_->num_examples(); }
  Result<Update> Train(std::span<const float> global, const Manifest& manifest, const v1::TaskConfig& task,
                       uint64_t round, std::string_view client_name) override;
  // A site of one CPU rank (parallel::DataParallelOptions::control); others
  // are refused in one line.
  Result<Update> TrainControlled(std::span<const float> global, const Manifest& manifest, const v1::TaskConfig& task,
                                 uint64_t round, std::string_view client_name, std::span<const float> control,
                                 std::span<const float> site_control) override;

  // Tells the followers rank 0 is alive and no round is in progress.
  Status KeepAlive();
  // Tells the followers the federation is over: ok ends them with 0, an error
  // with its message. Later KeepAlives do nothing.
  Status Finish(const Status& outcome);

  std::function<void(const Status&)> on_broken;

  // This site's own cap on a round's local training time, in seconds
  // (estuary-client --max-local-seconds; 0: none): the tighter of it and
  // the task's applies (client/local_deadline.h).
  void set_max_local_seconds(double seconds) { max_local_seconds_ = seconds; }

 private:
  Status SendHeader(uint32_t kind, uint64_t length);
  Status Broken(Status status);
  void RunPending();
  // "cuda::LlamaEngine on cuda:0 in bf16, 2 ranks (nccl, zero1)"; a model's
  // note in parentheses after its name ("models::Llama (recompute, arena N
  // bytes) on cpu ...", RankModel::note).
  std::string TrainedOn() const;

  std::unique_ptr<comm::Communicator> owned_;
  comm::Communicator& comm_;
  std::unique_ptr<RankTrainer> rank_;
  Status broken_;
  bool finished_ = false;
  double max_local_seconds_ = 0;
  parallel::ZeroStage stage_;
  Compute compute_;
  std::shared_ptr<UpdateStream> pending_;  // the last round's stream, until it has run
};

// Every rank but 0: follows rank 0's rounds until it says the federation is
// over. Returns ok when it ended well; an error when rank 0 gave up, a
// collective failed (a rank died) or this rank's training failed.
Status RunFollower(comm::Communicator& comm, RankTrainer& rank);

// What a site trains on: labelled images (the examples of `images` at
// `indices`, all of them when empty), a text's tokens, or instruction
// examples (models/instruction_set.h). One of the three.
struct SiteData {
  std::shared_ptr<const models::Dataset> images;
  std::vector<uint32_t> indices;
  std::shared_ptr<const std::vector<int32_t>> text;
  std::shared_ptr<const models::InstructionSet> instructions;
};

struct LocalSiteOptions {
  Compute compute;                                    // the CPU, or a GPU in a precision
  parallel::ZeroStage stage = parallel::ZeroStage::kDdp;
  int lora_rank = 0;                                  // RankModels::lora_rank
  DType lora_base = DType::kF32;                      // RankModels::lora_base
  bool recompute = false;                             // RankModels::recompute
  // Where the models live (RankModels::cache); unset: the site's own.
  std::function<ModelCache&()> cache;
};

// A site of one process: its one rank over a solo communicator on the
// compute's device, the CPU models or the GPU engines.
// Fails on a ZeRO stage the device cannot run (CheckStageOn).
Result<std::unique_ptr<SiteTrainer>> MakeLocalSite(SiteData data, const LocalSiteOptions& options);

}  // namespace estuary::client
