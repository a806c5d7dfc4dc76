// The CUDA ClassifierBackend: models::cuda::ClassifierEngine with the fused
// device SGD.
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <optional>
#include <tuple>

#include "client/classifier_backend.h"
#include "models/cuda/classifier_engine.h"

namespace estuary::client {

namespace {

class CudaClassifierBackend : public ClassifierBackend {
 public:
  explicit CudaClassifierBackend(models::cuda::ClassifierEngine engine) : engine_(std::move(engine)) {}
  const Manifest& manifest() const override { return engine_.manifest(); }
  int input_size() const override { return engine_.input_size(); }

  Status Begin(std::span<const float> global, const TaskConfig& task) override {
    ESTUARY_RETURN_IF_ERROR(engine_.CopyParametersFrom(global));
    // Device optimizer state is allocated once per round, outside the step loop.
    ESTUARY_ASSIGN_OR_RETURN(auto sgd, models::cuda::Sgd::Create(engine_.parameter_count(), task.learning_rate,
                                                                 task.momentum, task.weight_decay));
    sgd_.emplace(std::move(sgd));
    return Status::Ok();
  }

  Result<float> Step(const float* x, const int32_t* y, int n) override {
    ESTUARY_ASSIGN_OR_RETURN(const float loss, engine_.ForwardBackward(x, y, n));
    ESTUARY_RETURN_IF_ERROR(engine_.Step(*sgd_));
    return loss;
  }

  Status Finish(std::span<float> local) override { return engine_.CopyParametersTo(local); }

 private:
  models::cuda::ClassifierEngine engine_;
  std::optional<models::cuda::Sgd> sgd_;
};

}  // namespace

Result<ClassifierBackend*> ThreadCudaClassifierBackend(const std::string& model, int batch, const Compute& compute) {
  if (cudaError_t e = cudaSetDevice(compute.device_index); e != cudaSuccess) {
    return FailedPrecondition("trainer: cudaSetDevice({}) failed: {}", compute.device_index, cudaGetErrorString(e));
  }
  using Key = std::tuple<std::string, int, int, DType>;
  thread_local std::map<Key, std::unique_ptr<ClassifierBackend>> backends;
  const Key key{model, batch, compute.device_index, compute.precision};
  auto& slot = backends[key];
  if (!slot) {
    models::cuda::ClassifierEngineOptions options;
    options.precision = compute.precision;
    auto engine = models::cuda::ClassifierEngine::Create(model, batch, options);
    if (!engine.ok()) {
      backends.erase(key);
      return engine.status();
    }
    slot = std::make_unique<CudaClassifierBackend>(std::move(engine).value());
  }
  return slot.get();
}

}  // namespace estuary::client
