// The CUDA LmBackend: models::cuda::LlamaEngine with fused device optimizers.
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <optional>
#include <tuple>

#include "client/lm_backend.h"
#include "models/cuda/check.h"
#include "models/cuda/llama_engine.h"
#include "models/language_model.h"

namespace estuary::client {

namespace {

class CudaLmBackend : public LmBackend {
 public:
  explicit CudaLmBackend(models::cuda::LlamaEngine engine) : engine_(std::move(engine)) {}
  const Manifest& manifest() const override { return engine_.manifest(); }
  int max_seq_len() const override { return engine_.config().max_seq_len; }

  Status Begin(std::span<const float> global, const TaskConfig& task) override {
    ESTUARY_RETURN_IF_ERROR(engine_.CopyParametersFrom(global));
    optimizer_ = task.optimizer;
    const int64_t count = engine_.parameter_count();
    // Device optimizer state is allocated once per round, outside the step loop.
    if (optimizer_ == OptimizerKind::kAdamW) {
      ESTUARY_ASSIGN_OR_RETURN(auto adamw,
                               models::cuda::AdamW::Create(count, {.lr = task.learning_rate,
                                                                   .weight_decay = task.weight_decay},
                                                           engine_.stream()));
      adamw_.emplace(std::move(adamw));
    } else {
      ESTUARY_ASSIGN_OR_RETURN(auto sgd, models::cuda::Sgd::Create(count, task.learning_rate, task.momentum,
                                                                   task.weight_decay));
      sgd_.emplace(std::move(sgd));
    }
    return Status::Ok();
  }

  Result<float> Step(const int32_t* tokens, const int32_t* targets, int batch, int seq) override {
    ESTUARY_ASSIGN_OR_RETURN(const float loss, engine_.ForwardBackward(tokens, targets, batch, seq));
    // A skipped fp16 step (inf/NaN gradients) is the loss scaler's business, as with GradScaler.
    if (optimizer_ == OptimizerKind::kAdamW) {
      ESTUARY_RETURN_IF_ERROR(engine_.Step(*adamw_).status());
    } else {
      ESTUARY_RETURN_IF_ERROR(engine_.Step(*sgd_).status());
    }
    return loss;
  }

  Status Finish(std::span<float> local) override { return engine_.CopyParametersTo(local); }

 private:
  models::cuda::LlamaEngine engine_;
  OptimizerKind optimizer_ = OptimizerKind::kSgd;
  std::optional<models::cuda::AdamW> adamw_;
  std::optional<models::cuda::Sgd> sgd_;
};

}  // namespace

Result<LmBackend*> ThreadCudaLmBackend(const std::string& model, int batch, const Compute& compute) {
  if (cudaError_t e = cudaSetDevice(compute.device_index); e != cudaSuccess) {
    return FailedPrecondition("trainer: cudaSetDevice({}) failed: {}", compute.device_index, cudaGetErrorString(e));
  }
  using Key = std::tuple<std::string, int, int, DType>;
  thread_local std::map<Key, std::unique_ptr<LmBackend>> backends;
  const Key key{model, batch, compute.device_index, compute.precision};
  auto& slot = backends[key];
  if (!slot) {
    auto config = models::LlamaPreset(model);
    models::cuda::LlamaEngineOptions options;
    options.precision = compute.precision;
    auto engine = config.ok() ? models::cuda::LlamaEngine::Create(*config, batch, options)
                              : Result<models::cuda::LlamaEngine>(config.status());
    if (!engine.ok()) {
      backends.erase(key);
      return engine.status();
    }
    slot = std::make_unique<CudaLmBackend>(std::move(engine).value());
  }
  return slot.get();
}

}  // namespace estuary::client
