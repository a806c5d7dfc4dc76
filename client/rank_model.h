// RankModel: the model one rank of a site trains, as the site's rank
// trainers drive it — models::Llama / models::Model on the CPU (Gloo ranks),
// or cuda::LlamaEngine / cuda::ClassifierEngine on the rank's GPU (NCCL
// ranks). The training loops, the batch split and DataParallel above it are
// the same code for both.
//
//   auto dp = model->StartRound(comm, global, task, options);  // collective
//   loss = model->ForwardBackward(..., dp->MicroBatch(w, true));
//   dp->Step([&](auto slices) { model->OptimizerStep(slices); });
//   ESTUARY_RETURN_IF_ERROR(model->FinishStep());
//   model->ReadOut(*dp, fn);                                    // host values
//
// On a GPU the flat buffers are device memory and DataParallel runs DDP or
// ZeRO-1 over them on the engine's stream. Under DDP the engine's own fused
// step updates the whole buffer (clipping and the fp16 scaler see the same
// reduced gradients on every rank, so every rank decides alike); under ZeRO-1
// a device optimizer of 1/N the state steps the rank's pieces where they lie,
// and the all-gathered parameters refresh the engine's bf16 working copy.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <span>
#include <string>

#include "base/status.h"
#include "comm/communicator.h"
#include "client/compute.h"
#include "parallel/data_parallel.h"
#include "client/trainer.h"
#include "models/lora.h"
#include "models/step_hooks.h"
#include "models/tensor.h"

namespace estuary::client {

class RankModel {
 public:
  virtual ~RankModel() = default;
  virtual const Manifest& manifest() const = 0;
  // What trains, for the site's report of where a round ran: "models::Llama",
  // "cuda::LlamaEngine", ...; and the precision its arithmetic runs in.
  virtual std::string_view engine() const = 0;
  virtual DType precision() const = 0;
  // What the site's report adds after the engine's name, empty by default: a
  // decoder that recomputes activations says so with its activations' size
  // ("recompute, arena N bytes" on the CPU, the bytes it maps for the task's
  // batch; "recompute, activations N bytes" on a GPU).
  virtual std::string note() const { return {}; }
  // Loads the round's global weights, starts a fresh optimizer for the task
  // and this round's DataParallel over the model's buffers. Collective.
  virtual Result<std::unique_ptr<parallel::DataParallel>> StartRound(comm::Communicator& comm, std::span<const float> global,
                                                           const TaskConfig& task,
                                                           const parallel::DataParallelOptions& options) = 0;
  // The step DataParallel::Step calls back; a failure is kept for FinishStep.
  virtual void OptimizerStep(std::span<const models::ParameterSlice> slices) = 0;
  // After DataParallel::Step: whatever the model still owes the step (a
  // GPU's working copy after a ZeRO all-gather), and the first failure of
  // OptimizerStep since the last call.
  virtual Status FinishStep() = 0;
  // Hands out the trained parameters in host memory, as ForEachSlice does.
  virtual Status ReadOut(parallel::DataParallel& dp, const std::function<Status(uint64_t, std::span<const float>)>& fn) = 0;
};

// The decoders: token windows in, the mean next-token loss out.
class RankDecoder : public RankModel {
 public:
  virtual int max_seq_len() const = 0;
  virtual Result<float> ForwardBackward(const int32_t* tokens, const int32_t* targets, int batch, int seq,
                                        const models::BackwardOptions& options) = 0;
};

// The image models: x [n, input_size()] and labels in, the mean loss out.
class RankClassifier : public RankModel {
 public:
  virtual int input_size() const = 0;
  virtual Result<float> ForwardBackward(const float* x, const int32_t* y, int n,
                                        const models::BackwardOptions& options) = 0;
  // Forward, backward and a plain SGD step (no momentum) fused, where the
  // model has such a step (models::Model::TrainStepSgd): the same update as
  // ForwardBackward then OptimizerStep, for a step DataParallel would leave
  // as it is (one rank, DDP, no clipping or scaling). nullopt: no fused step.
  virtual std::optional<float> FusedSgdStep(const float* x, const int32_t* y, int n, float lr, float weight_decay) {
    return std::nullopt;
  }
};

// A decoder with LoRA adapters (models::LoraLlama on the CPU,
// cuda::LoraLlamaEngine on a GPU). Its frozen base is loaded apart
// (LoadBase); its buffers — what StartRound loads from `global`, what
// DataParallel trains and ReadOut hands out — are the adapter's, and
// manifest() is the adapter's. When the task's merge is frozen-a, FinishStep
// puts A back as StartRound loaded it: A is the federation's and must not
// move (AdamW's decay would move it even with a zero gradient).
class RankLoraDecoder : public RankDecoder {
 public:
  virtual const models::LoraConfig& lora_config() const = 0;
  // How the frozen base is stored: f32, or bf16 — the base rounded to bf16
  // (the CPU's LoraLlama in half the memory, models/lora.h; a GPU engine
  // under --precision bf16 drops its fp32 master, a third). Before LoadBase.
  virtual Status KeepBaseIn(DType dtype) = 0;
  // The frozen base's weights (the preset's layout) and the seed of this
  // round's dropout masks.
  virtual Status LoadBase(std::span<const float> base, uint64_t dropout_seed) = 0;
  // The token row of the whole global batch that this rank's next batch
  // starts at: its dropout masks are those one process draws for those rows.
  virtual void SetFirstRow(int64_t row) = 0;
};

// The models a rank trains, kept between rounds: made on a key's first use
// (the model, batch, adapters, device), reused after. A site keeps one model
// at a time (capacity 1: a task of another model replaces it); simulated
// sites share one cache per thread (ThreadModelCache), so a thousand sites on
// two threads hold two threads' models, not a thousand, and pay no page
// faults for fresh ones.
class ModelCache {
 public:
  explicit ModelCache(size_t capacity = 1) : capacity_(capacity) {}
  // The model under `key`, made by `make` if absent. A key names one model
  // type: the caller asks for it always as the same M.
  template <typename M>
  Result<M*> Get(const std::string& key, const std::function<Result<std::unique_ptr<M>>()>& make) {
    auto it = models_.find(key);
    if (it == models_.end()) {
      if (models_.size() >= capacity_) models_.clear();  // before making: never two at once
      ESTUARY_ASSIGN_OR_RETURN(std::unique_ptr<M> made, make());
      it = models_.emplace(key, std::move(made)).first;
    }
    return static_cast<M*>(it->second.get());
  }

 private:
  size_t capacity_;
  std::map<std::string, std::unique_ptr<RankModel>> models_;
};

// This thread's cache, of unbounded capacity.
ModelCache& ThreadModelCache();

// Makes a rank's model for a model name and batch size; called when a task
// names a model or batch size the rank does not hold yet.
template <typename M>
using RankModelFactory = std::function<Result<std::unique_ptr<M>>(const std::string& model, int max_batch)>;
using RankClassifierFactory = RankModelFactory<RankClassifier>;
// The decoders also take whether they recompute activations in backward
// (models::Llama::Create's recompute; the site's --recompute).
using RankDecoderFactory =
    std::function<Result<std::unique_ptr<RankDecoder>>(const std::string& model, int max_batch, bool recompute)>;

// A LoRA decoder for (model, max_batch, recompute, adapter config).
using RankLoraDecoderFactory = std::function<Result<std::unique_ptr<RankLoraDecoder>>(
    const std::string& model, int max_batch, bool recompute, const models::LoraConfig& lora)>;

// On the CPU: models::Llama, models::MakeModel, models::LoraLlama.
Result<std::unique_ptr<RankDecoder>> MakeCpuRankDecoder(const std::string& model, int max_batch, bool recompute);
Result<std::unique_ptr<RankClassifier>> MakeCpuRankClassifier(const std::string& model, int max_batch);
Result<std::unique_ptr<RankLoraDecoder>> MakeCpuRankLoraDecoder(const std::string& model, int max_batch,
                                                                bool recompute, const models::LoraConfig& lora);
// On compute's GPU, running on `stream` (a cudaStream_t, the one the rank's
// NCCL communicator follows). An error naming the reason in a build without CUDA.
Result<std::unique_ptr<RankDecoder>> MakeCudaRankDecoder(const std::string& model, int max_batch, bool recompute,
                                                         const Compute& compute, void* stream);
Result<std::unique_ptr<RankClassifier>> MakeCudaRankClassifier(const std::string& model, int max_batch,
                                                               const Compute& compute, void* stream);
// The adapters train in fp32 (their GEMMs read a bf16 copy under bf16);
// fp16 and dropout are refused, as cuda::LoraLlamaEngine refuses them.
Result<std::unique_ptr<RankLoraDecoder>> MakeCudaRankLoraDecoder(const std::string& model, int max_batch,
                                                                 bool recompute, const models::LoraConfig& lora,
                                                                 const Compute& compute, void* stream);

}  // namespace estuary::client
