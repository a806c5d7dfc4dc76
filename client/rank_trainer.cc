#include "client/rank_trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <optional>

#include "client/batch_schedule.h"
#include "client/local_deadline.h"
#include "client/lora_round.h"
#include "models/language_model.h"
#include "models/transformer_ops.h"

namespace estuary::client {

BatchShare ShareOfBatch(uint64_t n, int ranks, int rank) {
  const uint64_t base = n / uint64_t(ranks), extra = n % uint64_t(ranks), r = uint64_t(rank);
  return {r * base + std::min(r, extra), base + (r < extra ? 1 : 0)};
}

namespace {

// This rank's part of a global batch: the items it computes and the weight
// of its gradient (its examples over the batch's). An empty share still runs
// the step, on the batch's first item at weight 0: every rank's collectives
// must match.
struct RankRows {
  std::span<const uint32_t> items;
  uint64_t first = 0;     // the share's first item in the batch
  uint64_t examples = 0;  // 0 for an empty share
  double weight = 0;
};
RankRows RowsOf(std::span<const uint32_t> batch, const comm::Communicator& comm) {
  const BatchShare share = ShareOfBatch(batch.size(), comm.size(), comm.rank());
  if (share.count == 0) return {batch.first(1), 0, 0, 0.0};
  return {batch.subspan(share.begin, share.count), share.begin, share.count,
          double(share.count) / double(batch.size())};
}

// What every RankTrainer keeps between TrainRound and ReadOut: the round's
// DataParallel (under ZeRO-3 the trained parameters live only in its shards).
class RoundState {
 public:
  // After the epochs: the loss summed over ranks, over loss_count.
  Result<double> Finish(std::unique_ptr<parallel::DataParallel> dp, double loss_sum, double loss_count) {
    dp_ = std::move(dp);
    ESTUARY_ASSIGN_OR_RETURN(const double total, dp_->SumOverRanks(loss_sum));
    return total / loss_count;
  }
  // Hands the round's DataParallel to `read` (the model's read-out), then ends the round.
  Status ReadOut(const std::function<Status(parallel::DataParallel&)>& read) {
    if (!dp_) return FailedPrecondition("site: ReadOut without a trained round");
    Status s = read(*dp_);
    dp_.reset();
    return s;
  }

 private:
  std::unique_ptr<parallel::DataParallel> dp_;
};

// What both trainers share: the communicator, the DataParallel options, the
// models and where they are kept, the round in flight.
class RankTrainerBase : public RankTrainer {
 public:
  RankTrainerBase(comm::Communicator& comm, parallel::DataParallelOptions options, RankModels models)
      : comm_(comm), options_(options), models_(std::move(models)) {
    options_.broadcast_parameters = false;  // every rank starts from the same global weights
  }
  Status ReadOut(const std::function<Status(uint64_t, std::span<const float>)>& fn) override {
    return state_.ReadOut([&](parallel::DataParallel& dp) { return trained_->ReadOut(dp, fn); });
  }
  const RankModel* trained() const override { return trained_; }
  uint64_t steps() const override { return steps_; }
  void SetControl(std::span<const float> control, std::span<const float> site_control) override {
    control_ = control;
    site_control_ = site_control;
  }

 protected:
  // The model for `key` (after the kind, the model name and batch), made by
  // `make` on first use, in the cache the models live in.
  template <typename M>
  Result<M*> ModelFor(const TaskConfig& task, std::string_view kind, std::string_view extra,
                      const std::function<Result<std::unique_ptr<M>>()>& make) {
    const std::string key = fmt::format("{}/{}/{}/{}/{}", kind, task.model, task.batch_size, models_.device, extra);
    return (models_.cache ? models_.cache() : own_cache_).template Get<M>(key, make);
  }

  // A decoder that recomputes activations is another model than one that
  // does not: part of its cache key.
  std::string_view RecomputeKey() const { return models_.recompute ? "recompute" : ""; }

  // The site's DataParallel options with what the task adds: FedProx's μ,
  // and SCAFFOLD's control variates when set.
  parallel::DataParallelOptions RoundOptions(const TaskConfig& task) const {
    parallel::DataParallelOptions options = options_;
    options.proximal_mu = task.proximal_mu;
    options.control = control_;
    options.site_control = site_control_;
    return options;
  }

  comm::Communicator& comm_;
  parallel::DataParallelOptions options_;
  RankModels models_;
  ModelCache own_cache_;
  RankModel* trained_ = nullptr;  // the round's model
  uint64_t steps_ = 0;            // the round's optimizer steps
  std::span<const float> control_, site_control_;  // SCAFFOLD's c and c_i; empty: off
  RoundState state_;
};

class ClassifierRankTrainer : public RankTrainerBase {
 public:
  ClassifierRankTrainer(comm::Communicator& comm, std::shared_ptr<const models::Dataset> data,
                        std::vector<uint32_t> indices, parallel::DataParallelOptions options, RankModels models)
      : RankTrainerBase(comm, options, std::move(models)), data_(std::move(data)), indices_(std::move(indices)) {
    if (indices_.empty()) {
      indices_.resize(data_->size());
      std::iota(indices_.begin(), indices_.end(), 0u);
    }
  }

  uint64_t num_examples() const override { return indices_.size(); }

  Status Check(const TaskConfig& task, const Manifest& manifest, size_t global_size) override {
    if (task.optimizer != OptimizerKind::kSgd) {
      return InvalidArgument("task: model '{}' trains with sgd, not {}", task.model, OptimizerName(task.optimizer));
    }
    if (task.update_kind != UpdateKind::kFull) {
      return InvalidArgument("task: update kind lora needs a model with adapters; '{}' has none", task.model);
    }
    if (indices_.empty()) return FailedPrecondition("trainer: no local examples");
    ESTUARY_ASSIGN_OR_RETURN(RankClassifier * model, Model(task));
    if (!(model->manifest() == manifest) || global_size != manifest.total_elements) {
      return InvalidArgument("trainer: the global model's manifest does not match model '{}'", task.model);
    }
    if (data_->feature_size != model->input_size()) {
      return InvalidArgument("trainer: examples have {} features, model '{}' wants {}", data_->feature_size,
                             task.model, model->input_size());
    }
    return Status::Ok();
  }

  Result<double> TrainRound(std::span<const float> global, const TaskConfig& task, uint64_t round,
                            std::string_view client_name) override {
    ESTUARY_ASSIGN_OR_RETURN(RankClassifier * model, Model(task));
    trained_ = model;
    ESTUARY_ASSIGN_OR_RETURN(auto dp, model->StartRound(comm_, global, task, RoundOptions(task)));
    // One rank with nothing for DataParallel to do: plain SGD fuses into
    // backward where the model can (the same update, one pass fewer).
    const bool fusable = comm_.size() == 1 && options_.stage == parallel::ZeroStage::kDdp &&
                         options_.max_grad_norm == 0 && !options_.loss_scaler &&
                         task.optimizer == OptimizerKind::kSgd && task.momentum == 0 && task.proximal_mu == 0 &&
                         control_.empty();

    const int features = data_->feature_size;
    std::vector<float> x(size_t(task.batch_size) * features);
    std::vector<int32_t> y(task.batch_size);

    double epoch_loss = 0;  // this rank's share of the last epoch's loss sum
    uint64_t epoch_examples = 0;
    steps_ = 0;
    BatchSchedule schedule(indices_, task, round, client_name);
    LocalDeadline deadline(task.max_local_seconds, comm_);
    while (schedule.Next()) {
      if (schedule.starts_epoch()) epoch_loss = 0, epoch_examples = 0;
      const RankRows rows = RowsOf(schedule.batch(), comm_);
      for (size_t i = 0; i < rows.items.size(); ++i) {
        std::memcpy(x.data() + i * features, data_->row(rows.items[i]), features * sizeof(float));
        y[i] = data_->labels[rows.items[i]];
      }
      const int n = int(rows.items.size());
      std::optional<float> loss;
      if (fusable) loss = model->FusedSgdStep(x.data(), y.data(), n, task.learning_rate, task.weight_decay);
      if (loss) {
        ++steps_;
      } else {
        ESTUARY_ASSIGN_OR_RETURN(loss, model->ForwardBackward(x.data(), y.data(), n, dp->MicroBatch(rows.weight, true)));
        ESTUARY_ASSIGN_OR_RETURN(
            const parallel::StepResult stepped,
            dp->Step([&](std::span<const models::ParameterSlice> s) { model->OptimizerStep(s); }));
        if (stepped.stepped) ++steps_;
        ESTUARY_RETURN_IF_ERROR(model->FinishStep());
      }
      epoch_loss += double(*loss) * double(rows.examples);
      epoch_examples += schedule.batch().size();  // the whole global batch: every rank counts the same
      ESTUARY_ASSIGN_OR_RETURN(const bool out_of_time, deadline.Reached());
      if (out_of_time) break;
    }
    return state_.Finish(std::move(dp), epoch_loss, double(epoch_examples));
  }

 private:
  Result<RankClassifier*> Model(const TaskConfig& task) {
    return ModelFor<RankClassifier>(task, "classifier", "",
                                    [&] { return models_.classifier(task.model, int(task.batch_size)); });
  }

  std::shared_ptr<const models::Dataset> data_;
  std::vector<uint32_t> indices_;  // this site's examples within data_
};

class TextRankTrainer : public RankTrainerBase {
 public:
  // Exactly one of tokens and instructions is set.
  TextRankTrainer(comm::Communicator& comm, std::shared_ptr<const std::vector<int32_t>> tokens,
                  std::shared_ptr<const models::InstructionSet> instructions, parallel::DataParallelOptions options,
                  RankModels models)
      : RankTrainerBase(comm, options, std::move(models)), tokens_(std::move(tokens)),
        instructions_(std::move(instructions)) {}

  // Plain text: its tokens; instruction data: its scored targets.
  uint64_t num_examples() const override { return tokens_ ? tokens_->size() : instructions_->scored_tokens; }

  Status Check(const TaskConfig& task, const Manifest& manifest, size_t global_size) override {
    if (!models::IsLanguageModel(task.model)) {
      return InvalidArgument("task: model '{}' is not a language model; this site holds text", task.model);
    }
    ESTUARY_RETURN_IF_ERROR(CheckData(task));
    if (Windows(task) == 0) {
      return FailedPrecondition("trainer: {} local tokens hold no window of {} + 1",
                                tokens_ ? tokens_->size() : 0, task.seq_len);
    }
    if (task.update_kind == UpdateKind::kLora) {
      if (options_.stage == parallel::ZeroStage::kZero3) {
        return InvalidArgument("task: update kind lora on a site under --zero 3: the adapters open no unit to "
                               "gather; run it with --zero 0, 1 or 2");
      }
      ESTUARY_ASSIGN_OR_RETURN(const LoraRound plan, PlanLoraRound(task, models_.lora_rank));
      ESTUARY_RETURN_IF_ERROR(CheckLoraGlobal(plan, task, manifest, global_size));
      return LoraDecoder(task, plan.site).status();
    }
    ESTUARY_ASSIGN_OR_RETURN(RankDecoder * decoder, Decoder(task));
    if (!(decoder->manifest() == manifest) || global_size != manifest.total_elements) {
      return InvalidArgument("trainer: the global model's manifest does not match model '{}'", task.model);
    }
    if (int(task.seq_len) > decoder->max_seq_len()) {
      return InvalidArgument("task: seq_len {} exceeds {}'s context of {}", task.seq_len, task.model,
                             decoder->max_seq_len());
    }
    return Status::Ok();
  }

  Result<double> TrainRound(std::span<const float> global, const TaskConfig& task, uint64_t round,
                            std::string_view client_name) override {
    RankLoraDecoder* lora = nullptr;  // a lora round's decoder
    RankDecoder* decoder = nullptr;
    std::unique_ptr<parallel::DataParallel> dp;
    if (task.update_kind == UpdateKind::kLora) {
      ESTUARY_ASSIGN_OR_RETURN(plan_, PlanLoraRound(task, models_.lora_rank));
      ESTUARY_ASSIGN_OR_RETURN(const LoraStart start, StartLoraRound(*plan_, global, task, round, client_name));
      ESTUARY_ASSIGN_OR_RETURN(lora, LoraDecoder(task, plan_->site));
      ESTUARY_RETURN_IF_ERROR(lora->LoadBase(start.base(), start.dropout_seed));
      ESTUARY_ASSIGN_OR_RETURN(dp, lora->StartRound(comm_, start.adapter, task, RoundOptions(task)));
      decoder = lora;
    } else {
      plan_.reset();
      ESTUARY_ASSIGN_OR_RETURN(decoder, Decoder(task));
      ESTUARY_ASSIGN_OR_RETURN(dp, decoder->StartRound(comm_, global, task, RoundOptions(task)));
    }
    trained_ = decoder;

    const int seq = int(task.seq_len);
    std::vector<int32_t> inputs(size_t(task.batch_size) * seq), targets(inputs.size());
    const models::TrainingRows* packed = instructions_ ? &Packed(seq) : nullptr;
    // The targets a row scores: every one of a plain-text window.
    auto scored = [&](uint32_t row) -> uint64_t { return packed ? packed->scored[row] : uint64_t(seq); };

    double loss_sum = 0;  // this rank's share of the last epoch's loss sum
    uint64_t loss_tokens = 0;
    steps_ = 0;
    std::vector<uint32_t> order(Windows(task));
    std::iota(order.begin(), order.end(), 0u);
    BatchSchedule schedule(std::move(order), task, round, client_name);
    LocalDeadline deadline(task.max_local_seconds, comm_);
    while (schedule.Next()) {
      if (schedule.starts_epoch()) loss_sum = 0, loss_tokens = 0;
      const RankRows rows = RowsOf(schedule.batch(), comm_);
      for (size_t b = 0; b < rows.items.size(); ++b) {
        if (packed) {
          const size_t at = size_t(rows.items[b]) * seq;
          std::memcpy(inputs.data() + b * seq, packed->rows.tokens.data() + at, seq * sizeof(int32_t));
          std::memcpy(targets.data() + b * seq, packed->rows.targets.data() + at, seq * sizeof(int32_t));
          continue;
        }
        const int32_t* window = tokens_->data() + size_t(rows.items[b]) * seq;
        std::memcpy(inputs.data() + b * seq, window, seq * sizeof(int32_t));
        std::memcpy(targets.data() + b * seq, window + 1, seq * sizeof(int32_t));
      }
      // Each rank's loss is the mean over its own scored targets; weighted by
      // them over the global batch's (which every rank counts alike: each
      // holds every row), the ranks' summed gradients are the gradient of the
      // mean over the batch's scored targets, as one process forms it.
      uint64_t batch_scored = 0, rank_scored = 0;
      for (uint32_t row : schedule.batch()) batch_scored += scored(row);
      if (rows.examples > 0) {
        for (uint32_t row : rows.items) rank_scored += scored(row);
      }
      const double weight = batch_scored > 0 ? double(rank_scored) / double(batch_scored) : 0.0;
      if (lora) lora->SetFirstRow(int64_t(rows.first) * seq);
      ESTUARY_ASSIGN_OR_RETURN(const float loss,
                               decoder->ForwardBackward(inputs.data(), targets.data(), int(rows.items.size()), seq,
                                                        dp->MicroBatch(weight, true)));
      ESTUARY_ASSIGN_OR_RETURN(
          const parallel::StepResult stepped,
          dp->Step([&](std::span<const models::ParameterSlice> s) { decoder->OptimizerStep(s); }));
      if (stepped.stepped) ++steps_;
      ESTUARY_RETURN_IF_ERROR(decoder->FinishStep());
      loss_sum += double(loss) * double(rank_scored);
      loss_tokens += batch_scored;  // the whole global batch: every rank counts the same
      ESTUARY_ASSIGN_OR_RETURN(const bool out_of_time, deadline.Reached());
      if (out_of_time) break;
    }
    // An epoch that scored nothing (no row with a response in reach) has loss 0, as a batch of them does.
    return state_.Finish(std::move(dp), loss_sum, std::max<double>(double(loss_tokens), 1.0));
  }

  size_t TrainedSize(const TaskConfig& task, size_t global_size) const override {
    return task.update_kind == UpdateKind::kLora && plan_ ? plan_->site_layout.manifest.total_elements
                                                          : global_size;
  }
  Result<Update> UpdateOf(std::vector<float> trained, std::span<const float> global, const Manifest& manifest,
                          const TaskConfig& task, double train_loss, std::chrono::steady_clock::time_point start,
                          uint64_t round) override {
    if (task.update_kind != UpdateKind::kLora) {
      return RankTrainer::UpdateOf(std::move(trained), global, manifest, task, train_loss, start, round);
    }
    if (!plan_) return FailedPrecondition("site: a lora update without a lora round");
    return LoraUpdateOf(*plan_, global, trained, num_examples(), train_loss, start, round);
  }

 private:
  uint64_t Windows(const TaskConfig& task) {
    if (instructions_) return uint64_t(Packed(int(task.seq_len)).rows.rows());
    return tokens_->empty() ? 0 : (tokens_->size() - 1) / uint64_t(task.seq_len);
  }
  // The instruction rows of seq_len, packed on first use; kept while the
  // federation's seq_len stays.
  const models::TrainingRows& Packed(int seq_len) {
    if (!packed_ || packed_->rows.seq_len != seq_len) packed_ = models::PackForTraining(*instructions_, seq_len);
    return *packed_;
  }
  // What the data asks of the task and the device: the federation's template
  // is the one this site rendered with, and the model's vocabulary holds the
  // tokenizer's.
  Status CheckData(const TaskConfig& task) {
    const bool templated = !task.prompt_template.empty() && task.prompt_template != "none";
    if (!instructions_) {
      if (templated) {
        return InvalidArgument("task: template '{}': this site holds plain text, not instruction data (--data "
                               "FILE.jsonl --template {} --tokenizer FILE)",
                               task.prompt_template, task.prompt_template);
      }
      return Status::Ok();
    }
    const std::string_view mine = instructions_->template_name();
    if ((templated ? std::string_view(task.prompt_template) : std::string_view("none")) != mine) {
      return InvalidArgument("task: the federation's template is '{}', this site renders {} with '{}' (--template)",
                             templated ? task.prompt_template : std::string("none"), instructions_->file, mine);
    }
    ESTUARY_ASSIGN_OR_RETURN(const models::LlamaConfig config, models::LlamaPreset(task.model));
    if (instructions_->vocab_size > config.vocab_size) {
      return InvalidArgument("task: {}'s vocabulary of {} tokens does not hold the tokenizer's {} (--tokenizer)",
                             task.model, config.vocab_size, instructions_->vocab_size);
    }
    return Status::Ok();
  }
  Result<RankDecoder*> Decoder(const TaskConfig& task) {
    return ModelFor<RankDecoder>(task, "decoder", RecomputeKey(),
                                 [&] { return models_.decoder(task.model, int(task.batch_size), models_.recompute); });
  }
  // One per adapter config and way of keeping the base.
  Result<RankLoraDecoder*> LoraDecoder(const TaskConfig& task, const models::LoraConfig& config) {
    return ModelFor<RankLoraDecoder>(
        task, "lora", fmt::format("{}/{}/{}", LoraConfigKey(config), DTypeName(models_.lora_base), RecomputeKey()),
        [&]() -> Result<std::unique_ptr<RankLoraDecoder>> {
          ESTUARY_ASSIGN_OR_RETURN(auto made, models_.lora_decoder(task.model, int(task.batch_size),
                                                                   models_.recompute, config));
          ESTUARY_RETURN_IF_ERROR(made->KeepBaseIn(models_.lora_base));
          return made;
        });
  }

  std::shared_ptr<const std::vector<int32_t>> tokens_;
  std::shared_ptr<const models::InstructionSet> instructions_;
  std::optional<models::TrainingRows> packed_;
  std::optional<LoraRound> plan_;  // a lora round's
};

}  // namespace

std::unique_ptr<RankTrainer> MakeClassifierRankTrainer(comm::Communicator& comm,
                                                       std::shared_ptr<const models::Dataset> data,
                                                       std::vector<uint32_t> indices,
                                                       parallel::DataParallelOptions options, RankModels models) {
  return std::make_unique<ClassifierRankTrainer>(comm, std::move(data), std::move(indices), options,
                                                 std::move(models));
}

std::unique_ptr<RankTrainer> MakeTextRankTrainer(comm::Communicator& comm,
                                                 std::shared_ptr<const std::vector<int32_t>> tokens,
                                                 parallel::DataParallelOptions options, RankModels models) {
  return std::make_unique<TextRankTrainer>(comm, std::move(tokens), nullptr, options, std::move(models));
}

std::unique_ptr<RankTrainer> MakeInstructionRankTrainer(comm::Communicator& comm,
                                                        std::shared_ptr<const models::InstructionSet> instructions,
                                                        parallel::DataParallelOptions options, RankModels models) {
  return std::make_unique<TextRankTrainer>(comm, nullptr, std::move(instructions), options, std::move(models));
}

Status CheckStageOn(const Compute& compute, parallel::ZeroStage stage) {
  if (compute.device == Device::kCuda &&
      (stage == parallel::ZeroStage::kZero2 || stage == parallel::ZeroStage::kZero3)) {
    return InvalidArgument("--zero {} on {}: GPU ranks run DDP or ZeRO-1 (--zero 0|1); ZeRO-2/3 give pages of the "
                           "flat buffers back between uses, which a GPU buffer cannot (they run on CPU ranks)",
                           int(stage), compute.ToString());
  }
  return Status::Ok();
}

RankModels CudaModels(const Compute& compute, void* stream) {
  RankModels models;
  models.classifier = [compute, stream](const std::string& model, int batch) {
    return MakeCudaRankClassifier(model, batch, compute, stream);
  };
  models.decoder = [compute, stream](const std::string& model, int batch,
                                     bool recompute) -> Result<std::unique_ptr<RankDecoder>> {
    return MakeCudaRankDecoder(model, batch, recompute, compute, stream);
  };
  models.lora_decoder = [compute, stream](const std::string& model, int batch, bool recompute,
                                          const models::LoraConfig& lora) -> Result<std::unique_ptr<RankLoraDecoder>> {
    return MakeCudaRankLoraDecoder(model, batch, recompute, lora, compute, stream);
  };
  models.device = compute.ToString();
  return models;
}

size_t RankTrainer::TrainedSize(const TaskConfig&, size_t global_size) const { return global_size; }

Result<Update> RankTrainer::UpdateOf(std::vector<float> trained, std::span<const float> global,
                                     const Manifest& manifest, const TaskConfig&, double train_loss,
                                     std::chrono::steady_clock::time_point start, uint64_t round) {
  return FullUpdate(std::move(trained), global, manifest, num_examples(), train_loss, start, round);
}

}  // namespace estuary::client
