#include "client/classifier_backend.h"

#include <cstring>
#include <map>
#include <memory>
#include <optional>

#include "models/model.h"
#include "models/optimizer.h"

namespace estuary::client {

namespace {

class CpuClassifierBackend : public ClassifierBackend {
 public:
  explicit CpuClassifierBackend(std::unique_ptr<models::Model> model) : model_(std::move(model)) {}
  const Manifest& manifest() const override { return model_->manifest(); }
  int input_size() const override { return model_->input_size(); }

  Status Begin(std::span<const float> global, const TaskConfig& task) override {
    if (global.size() != model_->parameters().size()) {
      return InvalidArgument("trainer: {} global values for a model of {}", global.size(), model_->parameters().size());
    }
    std::memcpy(model_->parameters().data(), global.data(), global.size_bytes());
    task_ = task;
    sgd_.emplace(task.learning_rate, task.momentum, task.weight_decay);
    return Status::Ok();
  }

  Result<float> Step(const float* x, const int32_t* y, int n) override {
    // Without momentum the update fuses into backward (same result to rounding).
    if (task_.momentum == 0) return model_->TrainStepSgd(x, y, n, task_.learning_rate, task_.weight_decay);
    const float loss = model_->ForwardBackward(x, y, n);
    sgd_->Step(model_->parameters(), model_->gradients());
    return loss;
  }

  Status Finish(std::span<float> local) override {
    std::memcpy(local.data(), model_->parameters().data(), local.size_bytes());
    return Status::Ok();
  }

 private:
  std::unique_ptr<models::Model> model_;
  TaskConfig task_;
  std::optional<models::Sgd> sgd_;
};

}  // namespace

Result<ClassifierBackend*> ThreadClassifierBackend(const std::string& model, int batch, const Compute& compute) {
  if (compute.device == Device::kCuda) return ThreadCudaClassifierBackend(model, batch, compute);
  // The CPU model has no batch-sized state: one per model name.
  thread_local std::map<std::string, std::unique_ptr<ClassifierBackend>> backends;
  auto& slot = backends[model];
  if (!slot) {
    auto made = models::MakeModel(model);
    if (!made.ok()) {
      backends.erase(model);
      return made.status();
    }
    slot = std::make_unique<CpuClassifierBackend>(std::move(made).value());
  }
  return slot.get();
}

#ifndef ESTUARY_HAVE_CUDA
Result<ClassifierBackend*> ThreadCudaClassifierBackend(const std::string& model, int, const Compute& compute) {
  return FailedPrecondition("trainer: {} on {}: this build has no CUDA backend", model, compute.ToString());
}
#endif

}  // namespace estuary::client
