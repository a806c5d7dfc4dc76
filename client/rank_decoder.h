// RankDecoder: the decoder one rank of a text site trains, as the site's
// TextRankTrainer drives it — models::Llama on the CPU (Gloo ranks), or
// models::cuda::LlamaEngine on the rank's GPU (NCCL ranks). The training loop,
// the batch split and DataParallel above it are the same code for both.
//
//   auto dp = decoder->StartRound(comm, global, task, options);  // collective
//   loss = decoder->ForwardBackward(tokens, targets, b, seq, dp->MicroBatch(w, true));
//   dp->Step([&](auto p, auto g) { decoder->OptimizerStep(p, g); });
//   ESTUARY_RETURN_IF_ERROR(decoder->FinishStep());
//   decoder->ReadOut(*dp, fn);                                    // host values, unit by unit
//
// On a GPU the flat buffers are device memory and DataParallel runs DDP or
// ZeRO-1 over them on the engine's stream. Under DDP the engine's own fused
// step updates the whole buffer (clipping and the fp16 scaler see the same
// reduced gradients on every rank, so every rank decides alike); under ZeRO-1
// a device optimizer of 1/N the state steps the rank's shard, and the
// all-gathered parameters refresh the engine's bf16 working copy.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "base/status.h"
#include "client/communicator.h"
#include "client/compute.h"
#include "client/data_parallel.h"
#include "client/trainer.h"
#include "models/step_hooks.h"
#include "models/tensor.h"

namespace estuary::client {

class RankDecoder {
 public:
  virtual ~RankDecoder() = default;
  virtual const models::Manifest& manifest() const = 0;
  virtual int max_seq_len() const = 0;
  // Loads the round's global weights, starts a fresh optimizer for the task
  // and this round's DataParallel over the decoder's buffers. Collective.
  virtual Result<std::unique_ptr<DataParallel>> StartRound(Communicator& comm, std::span<const float> global,
                                                           const TaskConfig& task,
                                                           const DataParallelOptions& options) = 0;
  // The mean loss over this rank's tokens; the gradient as options say.
  virtual Result<float> ForwardBackward(const int32_t* tokens, const int32_t* targets, int batch, int seq,
                                        const models::BackwardOptions& options) = 0;
  // The step DataParallel::Step calls back; a failure is kept for FinishStep.
  virtual void OptimizerStep(std::span<float> params, std::span<const float> grads) = 0;
  // After DataParallel::Step: whatever the decoder still owes the step (a
  // GPU's working copy after a ZeRO all-gather), and the first failure of
  // OptimizerStep since the last call.
  virtual Status FinishStep() = 0;
  // Hands out the trained parameters in host memory, as ForEachSlice does.
  virtual Status ReadOut(DataParallel& dp, const std::function<Status(uint64_t, std::span<const float>)>& fn) = 0;
};

// Makes a rank's decoder for a model preset and batch; called when a task
// names a model or batch size the rank does not hold yet.
using RankDecoderFactory =
    std::function<Result<std::unique_ptr<RankDecoder>>(const std::string& model, int max_batch)>;

// models::Llama on the CPU.
Result<std::unique_ptr<RankDecoder>> MakeCpuRankDecoder(const std::string& model, int max_batch);
// models::cuda::LlamaEngine on compute's GPU, running on `stream` (a
// cudaStream_t, the one the rank's NCCL communicator follows). An error
// naming the reason in a build without CUDA.
Result<std::unique_ptr<RankDecoder>> MakeCudaRankDecoder(const std::string& model, int max_batch,
                                                         const Compute& compute, void* stream);

}  // namespace estuary::client
