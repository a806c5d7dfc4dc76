#include "client/lm_backend.h"

#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <tuple>

#include "models/language_model.h"
#include "models/optimizer.h"

namespace estuary::client {

namespace {

class CpuLmBackend : public LmBackend {
 public:
  explicit CpuLmBackend(models::Llama model) : model_(std::move(model)) {}
  const Manifest& manifest() const override { return model_.manifest(); }
  int max_seq_len() const override { return model_.config().max_seq_len; }

  Status Begin(std::span<const float> global, const TaskConfig& task) override {
    if (global.size() != model_.parameters().size()) {
      return InvalidArgument("trainer: {} global values for a model of {}", global.size(), model_.parameters().size());
    }
    std::memcpy(model_.parameters().data(), global.data(), global.size_bytes());
    optimizer_ = task.optimizer;
    sgd_.emplace(task.learning_rate, task.momentum, task.weight_decay);
    adamw_.emplace(models::AdamWOptions{.lr = task.learning_rate, .weight_decay = task.weight_decay});
    return Status::Ok();
  }

  Result<float> Step(const int32_t* tokens, const int32_t* targets, int batch, int seq) override {
    ESTUARY_ASSIGN_OR_RETURN(const float loss, model_.ForwardBackward(tokens, targets, batch, seq));
    if (optimizer_ == OptimizerKind::kAdamW) {
      adamw_->Step(model_.parameters(), model_.gradients());
    } else {
      sgd_->Step(model_.parameters(), model_.gradients());
    }
    return loss;
  }

  Status Finish(std::span<float> local) override {
    std::memcpy(local.data(), model_.parameters().data(), local.size_bytes());
    return Status::Ok();
  }

 private:
  models::Llama model_;
  OptimizerKind optimizer_ = OptimizerKind::kSgd;
  std::optional<models::Sgd> sgd_;
  std::optional<models::AdamW> adamw_;
};

}  // namespace

Result<LmBackend*> ThreadLmBackend(const std::string& model, int batch, const Compute& compute) {
  if (compute.device == Device::kCuda) return ThreadCudaLmBackend(model, batch, compute);
  thread_local std::map<std::pair<std::string, int>, std::unique_ptr<LmBackend>> backends;
  auto& slot = backends[{model, batch}];
  if (!slot) {
    auto config = models::LlamaPreset(model);
    if (!config.ok()) {
      backends.erase({model, batch});
      return config.status();
    }
    auto llama = models::Llama::Create(*config, batch);
    if (!llama.ok()) {
      backends.erase({model, batch});
      return llama.status();
    }
    slot = std::make_unique<CpuLmBackend>(std::move(llama).value());
  }
  return slot.get();
}

#ifndef ESTUARY_HAVE_CUDA
Result<LmBackend*> ThreadCudaLmBackend(const std::string& model, int, const Compute& compute) {
  return FailedPrecondition("trainer: {} on {}: this build has no CUDA backend", model, compute.ToString());
}
#endif

}  // namespace estuary::client
