// RankTrainer: one rank's half of a site's round — its share of every global
// batch, under DataParallel (DDP or a ZeRO stage) over the site's
// communicator. A site of N ranks runs one per rank (client/site.h); a site
// of one process runs one over a solo communicator, the same code.
//
// A round on N ranks is the round one process would train, to fp32 rounding:
// every rank holds the site's whole data set and walks the same BatchSchedule
// (task seed, round, client name), so all agree on the order; each global
// batch (the task's batch_size) is cut into N contiguous shares
// (ShareOfBatch), and rank r's gradient is weighted by n_r / n, so uneven
// splits stay exact (for the decoders n counts scored targets, not rows:
// instruction rows score some targets only). A rank whose share of a short last batch is empty still
// runs the step (one example at weight 0): the collectives of every rank must
// match. The reported loss is the sum of every rank's loss over its examples,
// agreed across ranks, over the examples of the last epoch — the mean one
// process reports.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "models/instruction_set.h"
#include "client/rank_model.h"
#include "client/trainer.h"
#include "comm/communicator.h"
#include "models/dataset.h"
#include "parallel/data_parallel.h"

namespace estuary::client {

// Rank r's contiguous share of a batch of n examples cut among `ranks`: the
// first n % ranks ranks take one example more.
struct BatchShare {
  uint64_t begin = 0;
  uint64_t count = 0;
};
BatchShare ShareOfBatch(uint64_t n, int ranks, int rank);

// Collective: every rank calls TrainRound and ReadOut with the same arguments.
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
  // After TrainRound: the model that trained ("cuda::LlamaEngine", ...).
  virtual const RankModel* trained() const = 0;
  // After TrainRound: the optimizer steps it took (a step a loss scaler
  // skipped for inf/NaN is not one); the same on every rank.
  virtual uint64_t steps() const = 0;
  // SCAFFOLD: the next rounds correct every gradient by (control -
  // site_control) (parallel::DataParallelOptions::control), until set empty.
  // The spans must outlive those rounds.
  virtual void SetControl(std::span<const float> control, std::span<const float> site_control) = 0;

  // Rank 0, after TrainRound: how many values ReadOut hands out, and the
  // round's update from them (not collective). By default the trained
  // weights are the whole model and the update is their delta (FullUpdate).
  virtual size_t TrainedSize(const TaskConfig& task, size_t global_size) const;
  virtual Result<Update> UpdateOf(std::vector<float> trained, std::span<const float> global,
                                  const Manifest& manifest, const TaskConfig& task, double train_loss,
                                  std::chrono::steady_clock::time_point start, uint64_t round);
};

// How a rank makes its models and where it keeps them: on the CPU by
// default, or on a GPU (CudaModels).
struct RankModels {
  RankClassifierFactory classifier = MakeCpuRankClassifier;
  RankDecoderFactory decoder = MakeCpuRankDecoder;
  RankLoraDecoderFactory lora_decoder = MakeCpuRankLoraDecoder;
  std::string device = "cpu";  // part of the cache keys: one thread's cache may hold several devices' models
  // The cache the models live in, asked on the training thread; unset: the
  // trainer's own, one model at a time. Simulated sites share ThreadModelCache.
  std::function<ModelCache&()> cache;
  int lora_rank = 0;              // this site's adapter rank in a federation of mixed ranks (0: the federation's)
  DType lora_base = DType::kF32;  // how the frozen base is kept (RankLoraDecoder::KeepBaseIn)
  bool recompute = false;         // the decoders recompute activations in backward (the site's --recompute)
};

// GPU ranks run DDP or ZeRO-1: ZeRO-2/3 give pages of the flat buffers back
// between uses, which a GPU buffer cannot. The error names the flag.
Status CheckStageOn(const Compute& compute, parallel::ZeroStage stage);


// The GPU engines on compute's device, running on `stream` (a cudaStream_t,
// the one an NCCL communicator follows; null: each engine's own).
RankModels CudaModels(const Compute& compute, void* stream);

// The image models (MLP, CNN) with SGD, on the examples of `data` at
// `indices` (empty: all of them; a simulated site's shard, not copied).
std::unique_ptr<RankTrainer> MakeClassifierRankTrainer(comm::Communicator& comm,
                                                       std::shared_ptr<const models::Dataset> data,
                                                       std::vector<uint32_t> indices,
                                                       parallel::DataParallelOptions options, RankModels models = {});
// The decoders with SGD or AdamW, as full or lora rounds. A lora round under
// ZeRO-3 is refused by Check: the adapters open no unit to gather (it runs
// under DDP, ZeRO-1 and ZeRO-2).
std::unique_ptr<RankTrainer> MakeTextRankTrainer(comm::Communicator& comm,
                                                 std::shared_ptr<const std::vector<int32_t>> tokens,
                                                 parallel::DataParallelOptions options, RankModels models = {});
// The same decoders on instruction rows (models/instruction_set.h): packed
// to the task's seq_len, each rank's gradient weighted by its scored targets
// over the global batch's. A task of another template, a model whose
// vocabulary is smaller than the tokenizer's, or a GPU rank is refused by Check.
std::unique_ptr<RankTrainer> MakeInstructionRankTrainer(comm::Communicator& comm,
                                                        std::shared_ptr<const models::InstructionSet> instructions,
                                                        parallel::DataParallelOptions options, RankModels models = {});

}  // namespace estuary::client
