// The GPU rank models: cuda::LlamaEngine, cuda::ClassifierEngine and
// cuda::LoraLlamaEngine under DDP or ZeRO-1 over NCCL (client/rank_model.h).
#include <cuda_runtime_api.h>

#include <optional>
#include <utility>
#include <vector>

#include "client/lora_round.h"
#include "client/rank_model.h"
#include "models/cuda/classifier_engine.h"
#include "models/cuda/llama_engine.h"
#include "models/cuda/lora_engine.h"
#include "models/cuda/optimizer.h"
#include "models/language_model.h"
#include "models/lora_federation.h"

namespace estuary::client {

namespace {

// What both engines share as a rank's model: the round's optimizer (over the
// whole buffer under DDP, the shard under ZeRO-1), the step, the read-out.
template <typename Engine, typename Base>
class CudaRankModel : public Base {
 public:
  explicit CudaRankModel(Engine engine) : engine_(std::move(engine)) {}

  const Manifest& manifest() const override { return engine_.manifest(); }
  DType precision() const override { return engine_.precision(); }

  Result<std::unique_ptr<parallel::DataParallel>> StartRound(comm::Communicator& comm, std::span<const float> global,
                                                   const TaskConfig& task,
                                                   const parallel::DataParallelOptions& options) override {
    if (global.size() != manifest().total_elements) {
      return InvalidArgument("site: {} global values for model '{}' of {}", global.size(), task.model,
                             manifest().total_elements);
    }
    if (options.stage != parallel::ZeroStage::kDdp && engine_.precision() == DType::kF16) {
      // The engine scales an fp16 loss by its own scaler, which sees all of
      // the gradients; under ZeRO a rank steps only its shard.
      return InvalidArgument("site: fp16 with {} on a GPU: the fp16 loss scaler runs with DDP only; use bf16 or "
                             "--zero 0",
                             parallel::ZeroStageName(options.stage));
    }
    ESTUARY_RETURN_IF_ERROR(engine_.CopyParametersFrom(global));
    const size_t n = size_t(engine_.parameter_count());
    parallel::DataParallelOptions on_stream = options;
    on_stream.device_stream = engine_.stream();
    ESTUARY_ASSIGN_OR_RETURN(auto dp, parallel::DataParallel::Create(comm, std::span<float>(engine_.parameters(), n),
                                                           std::span<float>(engine_.gradients(), n), engine_.units(),
                                                           on_stream));
    // Under ZeRO the optimizer steps this rank's shard only: its state is 1/N.
    sharded_ = dp->stage() != parallel::ZeroStage::kDdp;
    const int64_t count = sharded_ ? int64_t(dp->shard_size()) : int64_t(n);
    adamw_.reset();
    sgd_.reset();
    if (task.optimizer == OptimizerKind::kAdamW) {
      ESTUARY_ASSIGN_OR_RETURN(auto adamw, models::cuda::AdamW::Create(
                                               count, {.lr = task.learning_rate, .weight_decay = task.weight_decay},
                                               engine_.stream()));
      adamw_.emplace(std::move(adamw));
    } else {
      ESTUARY_ASSIGN_OR_RETURN(auto sgd,
                               models::cuda::Sgd::Create(count, task.learning_rate, task.momentum, task.weight_decay));
      sgd_.emplace(std::move(sgd));
    }
    return dp;
  }

  void OptimizerStep(std::span<const models::ParameterSlice> slices) override {
    Status s;
    if (!sharded_) {
      // DDP: the one slice is the engine's own buffers; its fused step also
      // writes the working copy the GEMMs read.
      s = Unwrap(adamw_ ? engine_.Step(*adamw_) : engine_.Step(*sgd_));
    } else {
      // ZeRO-1: this rank's pieces of the flat buffers, on the engine's
      // stream; the all-gather that follows writes the rest of the flat
      // buffer, and FinishStep the working copy.
      s = adamw_ ? adamw_->Step(slices, engine_.stream()) : sgd_->Step(slices, engine_.stream());
    }
    if (!s.ok() && error_.ok()) error_ = std::move(s);
  }

  Status FinishStep() override {
    if (sharded_ && error_.ok()) error_ = engine_.RefreshWorkingCopy();
    return std::exchange(error_, Status::Ok());
  }

  Status ReadOut(parallel::DataParallel&, const std::function<Status(uint64_t, std::span<const float>)>& fn) override {
    host_.resize(size_t(engine_.parameter_count()));
    ESTUARY_RETURN_IF_ERROR(engine_.CopyParametersTo(host_));
    return fn(0, host_);
  }

 protected:
  // LlamaEngine::Step says whether an fp16 step ran; ClassifierEngine's has no scaler.
  static Status Unwrap(const Status& s) { return s; }
  static Status Unwrap(const Result<bool>& r) { return r.status(); }

  Engine engine_;
  std::optional<models::cuda::AdamW> adamw_;
  std::optional<models::cuda::Sgd> sgd_;
  bool sharded_ = false;  // ZeRO-1: the optimizer steps the shard
  Status error_;
  std::vector<float> host_;
};

// "recompute, activations N bytes" for an engine that recomputes.
std::string RecomputeNote(const models::cuda::LlamaEngine& engine) {
  if (!engine.recompute()) return {};
  return fmt::format("recompute, activations {} bytes", engine.activation_bytes());
}

class CudaRankDecoder : public CudaRankModel<models::cuda::LlamaEngine, RankDecoder> {
 public:
  using CudaRankModel::CudaRankModel;
  std::string_view engine() const override { return "cuda::LlamaEngine"; }
  std::string note() const override { return RecomputeNote(engine_); }
  int max_seq_len() const override { return engine_.config().max_seq_len; }
  Result<float> ForwardBackward(const int32_t* tokens, const int32_t* targets, int batch, int seq,
                                const models::BackwardOptions& options) override {
    ESTUARY_RETURN_IF_ERROR(engine_.ForwardBackwardAsync(tokens, targets, batch, seq, options));
    return engine_.ReadLoss();
  }
};

class CudaRankClassifier : public CudaRankModel<models::cuda::ClassifierEngine, RankClassifier> {
 public:
  using CudaRankModel::CudaRankModel;
  std::string_view engine() const override { return "cuda::ClassifierEngine"; }
  int input_size() const override { return engine_.input_size(); }
  Result<float> ForwardBackward(const float* x, const int32_t* y, int n,
                                const models::BackwardOptions& options) override {
    ESTUARY_RETURN_IF_ERROR(engine_.ForwardBackwardAsync(x, y, n, options));
    return engine_.ReadLoss();
  }
};

// cuda::LoraLlamaEngine: the same round, optimizer and step over the adapter
// buffer; FinishStep first puts frozen-a's A back (and then rewrites the
// adapters' working copy, which the fused step wrote from the moved A).
class CudaRankLoraDecoder : public CudaRankModel<models::cuda::LoraLlamaEngine, RankLoraDecoder> {
 public:
  using CudaRankModel::CudaRankModel;
  std::string_view engine() const override { return "cuda::LoraLlamaEngine"; }
  std::string note() const override { return RecomputeNote(engine_.base()); }
  int max_seq_len() const override { return engine_.base().config().max_seq_len; }
  const models::LoraConfig& lora_config() const override { return engine_.lora_config(); }

  // bf16: the base engine drops its fp32 master and keeps only the bf16
  // working copy its GEMMs read, so it computes in bf16 too.
  Status KeepBaseIn(DType dtype) override {
    if (dtype == DType::kF32) return Status::Ok();
    if (dtype != DType::kBF16 || engine_.precision() != DType::kBF16) {
      return InvalidArgument("site: a frozen base kept in {} on a GPU needs --precision bf16 (the base's GEMMs read "
                             "the weights as stored); this engine runs in {}",
                             DTypeName(dtype), DTypeName(engine_.precision()));
    }
    return engine_.base().DropFp32Master();
  }
  Status LoadBase(std::span<const float> base, uint64_t) override {
    // The GPU adapters have no dropout (Create refuses it): no seed to keep.
    return engine_.base().CopyParametersFrom(base);
  }
  void SetFirstRow(int64_t) override {}

  Result<std::unique_ptr<parallel::DataParallel>> StartRound(comm::Communicator& comm, std::span<const float> global,
                                                   const TaskConfig& task,
                                                   const parallel::DataParallelOptions& options) override {
    ESTUARY_ASSIGN_OR_RETURN(auto dp, CudaRankModel::StartRound(comm, global, task, options));
    frozen_.Start(task, global);
    return dp;
  }

  Status FinishStep() override {
    if (error_.ok() && frozen_.active()) {
      error_ = frozen_.Restore(engine_.manifest(), [&](uint64_t offset, std::span<const float> a) {
        return engine_.CopyParametersFrom(offset, a);
      });
      if (error_.ok() && !sharded_) error_ = engine_.RefreshWorkingCopy();  // ZeRO-1's is refreshed below
    }
    return CudaRankModel::FinishStep();
  }

  Result<float> ForwardBackward(const int32_t* tokens, const int32_t* targets, int batch, int seq,
                                const models::BackwardOptions& options) override {
    ESTUARY_RETURN_IF_ERROR(engine_.ForwardBackwardAsync(tokens, targets, batch, seq, options));
    return engine_.ReadLoss();
  }

 private:
  FrozenA frozen_;
};

Status UseDevice(const Compute& compute) {
  if (compute.device != Device::kCuda) {
    return InvalidArgument("site: a GPU rank needs a cuda device, not {}", compute.ToString());
  }
  if (cudaError_t e = cudaSetDevice(compute.device_index); e != cudaSuccess) {
    return FailedPrecondition("site: cudaSetDevice({}) failed: {}", compute.device_index, cudaGetErrorString(e));
  }
  return Status::Ok();
}

// The decoder engines' options for a rank: its precision, on its stream.
models::cuda::LlamaEngineOptions LlamaOptionsOn(const Compute& compute, void* stream, bool recompute) {
  models::cuda::LlamaEngineOptions options;
  options.precision = compute.precision;
  options.stream = static_cast<cudaStream_t>(stream);
  options.recompute = recompute;
  return options;
}


}  // namespace

Result<std::unique_ptr<RankDecoder>> MakeCudaRankDecoder(const std::string& model, int max_batch, bool recompute,
                                                         const Compute& compute, void* stream) {
  ESTUARY_RETURN_IF_ERROR(UseDevice(compute));
  ESTUARY_ASSIGN_OR_RETURN(const models::LlamaConfig config, models::LlamaPreset(model));
  ESTUARY_ASSIGN_OR_RETURN(auto engine,
                           models::cuda::LlamaEngine::Create(config, max_batch,
                                                                             LlamaOptionsOn(compute, stream, recompute)));
  return std::unique_ptr<RankDecoder>(std::make_unique<CudaRankDecoder>(std::move(engine)));
}

Result<std::unique_ptr<RankClassifier>> MakeCudaRankClassifier(const std::string& model, int max_batch,
                                                               const Compute& compute, void* stream) {
  ESTUARY_RETURN_IF_ERROR(UseDevice(compute));
  models::cuda::ClassifierEngineOptions options;
  options.precision = compute.precision;
  options.stream = static_cast<cudaStream_t>(stream);
  ESTUARY_ASSIGN_OR_RETURN(auto engine, models::cuda::ClassifierEngine::Create(model, max_batch, options));
  return std::unique_ptr<RankClassifier>(std::make_unique<CudaRankClassifier>(std::move(engine)));
}

Result<std::unique_ptr<RankLoraDecoder>> MakeCudaRankLoraDecoder(const std::string& model, int max_batch,
                                                                 bool recompute, const models::LoraConfig& lora,
                                                                 const Compute& compute, void* stream) {
  ESTUARY_RETURN_IF_ERROR(UseDevice(compute));
  ESTUARY_ASSIGN_OR_RETURN(const models::LlamaConfig config, models::LlamaPreset(model));
  ESTUARY_ASSIGN_OR_RETURN(auto engine, models::cuda::LoraLlamaEngine::Create(config, lora, max_batch,
                                                                              LlamaOptionsOn(compute, stream, recompute)));
  return std::unique_ptr<RankLoraDecoder>(std::make_unique<CudaRankLoraDecoder>(std::move(engine)));
}

}  // namespace estuary::client
