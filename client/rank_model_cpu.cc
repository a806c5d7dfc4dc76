// The CPU rank models: models::Model (the MLP and CNN), models::Llama and
// models::LoraLlama with the host optimizers, stepping whatever slices
// DataParallel hands them (client/rank_model.h).
#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "client/lora_round.h"
#include "client/rank_model.h"
#include "models/language_model.h"
#include "models/llama.h"
#include "models/lora.h"
#include "models/model.h"
#include "models/optimizer.h"

namespace estuary::client {

namespace {

// The optimizer of a round, stepping whatever span DataParallel hands it (the
// whole buffer under DDP, this rank's shard under ZeRO).
class RoundOptimizer {
 public:
  explicit RoundOptimizer(const TaskConfig& task) {
    if (task.optimizer == OptimizerKind::kAdamW) {
      adamw_.emplace(models::AdamWOptions{.lr = task.learning_rate, .weight_decay = task.weight_decay});
    } else {
      sgd_.emplace(task.learning_rate, task.momentum, task.weight_decay);
    }
  }
  void Step(std::span<const models::ParameterSlice> slices) {
    if (adamw_) {
      adamw_->Step(slices);
    } else {
      sgd_->Step(slices);
    }
  }

 private:
  std::optional<models::Sgd> sgd_;
  std::optional<models::AdamW> adamw_;
};

// Loads a round's global weights into this rank's model and starts its
// DataParallel. Collective.
template <typename M>
Result<std::unique_ptr<parallel::DataParallel>> StartRound(comm::Communicator& comm, M& model, std::span<const float> global,
                                                 const TaskConfig& task, const parallel::DataParallelOptions& options) {
  if (global.size() != model.parameters().size()) {
    return InvalidArgument("site: {} global values for model '{}' of {}", global.size(), task.model,
                           model.parameters().size());
  }
  std::copy(global.begin(), global.end(), model.parameters().begin());
  return parallel::DataParallel::Create(comm, model, options);
}

// A CPU rank's model (models::Model, models::Llama, models::LoraLlama) with
// the site's host optimizers, stepping whatever slices DataParallel hands them.
template <typename Model, typename Base>
class CpuRankModel : public Base {
 public:
  explicit CpuRankModel(std::unique_ptr<Model> model) : model_(std::move(model)) {}
  const Manifest& manifest() const override { return model_->manifest(); }
  DType precision() const override { return DType::kF32; }
  Result<std::unique_ptr<parallel::DataParallel>> StartRound(comm::Communicator& comm, std::span<const float> global,
                                                             const TaskConfig& task,
                                                             const parallel::DataParallelOptions& options) override {
    optimizer_.emplace(task);
    return client::StartRound(comm, *model_, global, task, options);
  }
  void OptimizerStep(std::span<const models::ParameterSlice> slices) override { optimizer_->Step(slices); }
  Status FinishStep() override { return Status::Ok(); }
  Status ReadOut(parallel::DataParallel& dp, const std::function<Status(uint64_t, std::span<const float>)>& fn) override {
    return dp.ForEachSlice(fn);
  }

 protected:
  std::unique_ptr<Model> model_;

 private:
  std::optional<RoundOptimizer> optimizer_;
};

// The decoders, full and adapted: token windows in, the mean loss out.
template <typename Model, typename Base>
class CpuDecoderModel : public CpuRankModel<Model, Base> {
 public:
  using CpuRankModel<Model, Base>::CpuRankModel;
  Result<float> ForwardBackward(const int32_t* tokens, const int32_t* targets, int batch, int seq,
                                const models::BackwardOptions& options) override {
    return this->model_->ForwardBackward(tokens, targets, batch, seq, options);
  }
};

// "recompute, arena N bytes" for a decoder that recomputes activations.
std::string RecomputeNote(const models::Llama& model) {
  if (!model.recompute()) return {};
  return fmt::format("recompute, arena {} bytes", model.activation_arena().size_bytes());
}

class CpuRankDecoder : public CpuDecoderModel<models::Llama, RankDecoder> {
 public:
  using CpuDecoderModel::CpuDecoderModel;
  std::string_view engine() const override { return "models::Llama"; }
  std::string note() const override { return RecomputeNote(*model_); }
  int max_seq_len() const override { return model_->config().max_seq_len; }
};

class CpuRankClassifier : public CpuRankModel<models::Model, RankClassifier> {
 public:
  using CpuRankModel::CpuRankModel;
  std::string_view engine() const override { return "models::Model"; }
  int input_size() const override { return model_->input_size(); }
  Result<float> ForwardBackward(const float* x, const int32_t* y, int n,
                                const models::BackwardOptions& options) override {
    return model_->ForwardBackward(x, y, n, options);
  }
  std::optional<float> FusedSgdStep(const float* x, const int32_t* y, int n, float lr, float weight_decay) override {
    return model_->TrainStepSgd(x, y, n, lr, weight_decay);
  }
};

class CpuRankLoraDecoder : public CpuDecoderModel<models::LoraLlama, RankLoraDecoder> {
 public:
  using CpuDecoderModel::CpuDecoderModel;
  std::string_view engine() const override { return "models::LoraLlama"; }
  std::string note() const override { return RecomputeNote(model_->base()); }
  int max_seq_len() const override { return model_->base().config().max_seq_len; }
  const models::LoraConfig& lora_config() const override { return model_->lora_config(); }

  Status KeepBaseIn(DType dtype) override {
    if (dtype == DType::kF32 && !model_->base_in_bf16()) return Status::Ok();
    if (dtype == DType::kBF16) {
      if (!model_->base_in_bf16()) model_->StoreBaseInBf16();
      return Status::Ok();
    }
    return InvalidArgument("site: a frozen base in {} on the CPU (f32 or bf16, chosen once)", DTypeName(dtype));
  }
  Status LoadBase(std::span<const float> base, uint64_t dropout_seed) override {
    ESTUARY_RETURN_IF_ERROR(model_->LoadBase(base));
    model_->SeedDropout(dropout_seed);
    return Status::Ok();
  }
  void SetFirstRow(int64_t row) override { model_->SetDropoutFirstRow(row); }

  Result<std::unique_ptr<parallel::DataParallel>> StartRound(comm::Communicator& comm, std::span<const float> global,
                                                             const TaskConfig& task,
                                                             const parallel::DataParallelOptions& options) override {
    ESTUARY_ASSIGN_OR_RETURN(auto dp, CpuDecoderModel::StartRound(comm, global, task, options));
    frozen_.Start(task, global);
    return dp;
  }
  Status FinishStep() override {
    return frozen_.Restore(model_->manifest(), [&](uint64_t offset, std::span<const float> a) {
      std::copy(a.begin(), a.end(), model_->parameters().begin() + offset);
      return Status::Ok();
    });
  }

 private:
  FrozenA frozen_;
};

}  // namespace

ModelCache& ThreadModelCache() {
  thread_local ModelCache cache(SIZE_MAX);
  return cache;
}

Result<std::unique_ptr<RankDecoder>> MakeCpuRankDecoder(const std::string& model, int max_batch, bool recompute) {
  ESTUARY_ASSIGN_OR_RETURN(auto config, models::LlamaPreset(model));
  ESTUARY_ASSIGN_OR_RETURN(auto llama, models::Llama::Create(config, max_batch, recompute));
  return std::unique_ptr<RankDecoder>(std::make_unique<CpuRankDecoder>(std::make_unique<models::Llama>(std::move(llama))));
}

Result<std::unique_ptr<RankLoraDecoder>> MakeCpuRankLoraDecoder(const std::string& model, int max_batch,
                                                                bool recompute, const models::LoraConfig& lora) {
  ESTUARY_ASSIGN_OR_RETURN(auto config, models::LlamaPreset(model));
  ESTUARY_ASSIGN_OR_RETURN(auto base, models::Llama::Create(config, max_batch, recompute));
  ESTUARY_ASSIGN_OR_RETURN(auto adapted, models::LoraLlama::Create(std::move(base), lora));
  return std::unique_ptr<RankLoraDecoder>(std::make_unique<CpuRankLoraDecoder>(std::make_unique<models::LoraLlama>(std::move(adapted))));
}

Result<std::unique_ptr<RankClassifier>> MakeCpuRankClassifier(const std::string& model, int) {
  ESTUARY_ASSIGN_OR_RETURN(auto cpu, models::MakeModel(model));
  return std::unique_ptr<RankClassifier>(std::make_unique<CpuRankClassifier>(std::move(cpu)));
}

#ifndef ESTUARY_HAVE_CUDA
Result<std::unique_ptr<RankDecoder>> MakeCudaRankDecoder(const std::string& model, int, bool,
                                                         const Compute& compute, void*) {
  return FailedPrecondition("site: {} on {}: this build has no CUDA backend", model, compute.ToString());
}
Result<std::unique_ptr<RankClassifier>> MakeCudaRankClassifier(const std::string& model, int,
                                                               const Compute& compute, void*) {
  return FailedPrecondition("site: {} on {}: this build has no CUDA backend", model, compute.ToString());
}
Result<std::unique_ptr<RankLoraDecoder>> MakeCudaRankLoraDecoder(const std::string& model, int, bool,
                                                                 const models::LoraConfig&, const Compute& compute,
                                                                 void*) {
  return FailedPrecondition("site: {} with LoRA on {}: this build has no CUDA backend", model, compute.ToString());
}
#endif
}  // namespace estuary::client
