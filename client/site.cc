#include "client/site.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>

#include "client/batch_schedule.h"
#include "client/lora_round.h"
#include "models/language_model.h"
#include "models/llama.h"
#include "models/lora.h"
#include "models/lora_federation.h"
#include "models/model.h"
#include "models/optimizer.h"

namespace estuary::client {

BatchShare ShareOfBatch(uint64_t n, int ranks, int rank) {
  const uint64_t base = n / uint64_t(ranks), extra = n % uint64_t(ranks), r = uint64_t(rank);
  return {r * base + std::min(r, extra), base + (r < extra ? 1 : 0)};
}

namespace {

Status Await(std::unique_ptr<comm::Work> work) { return work->Wait(); }

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
  Status ReadOut(const std::function<Status(uint64_t, std::span<const float>)>& fn) {
    return ReadOut([&](parallel::DataParallel& dp) { return dp.ForEachSlice(fn); });
  }
  // The same, through a reader of the round's DataParallel.
  Status ReadOut(const std::function<Status(parallel::DataParallel&)>& read) {
    if (!dp_) return FailedPrecondition("site: ReadOut without a trained round");
    Status s = read(*dp_);
    dp_.reset();
    return s;
  }

 private:
  std::unique_ptr<parallel::DataParallel> dp_;
};

class ClassifierRankTrainer : public RankTrainer {
 public:
  ClassifierRankTrainer(comm::Communicator& comm, std::shared_ptr<const models::Dataset> data, parallel::DataParallelOptions options,
                        RankClassifierFactory make_model)
      : comm_(comm), data_(std::move(data)), options_(options), make_model_(std::move(make_model)) {
    options_.broadcast_parameters = false;  // every rank starts from the same global weights
  }

  uint64_t num_examples() const override { return data_->size(); }
  Status ReadOut(const std::function<Status(uint64_t, std::span<const float>)>& fn) override {
    return state_.ReadOut([&](parallel::DataParallel& dp) { return model_->ReadOut(dp, fn); });
  }

  Status Check(const TaskConfig& task, const Manifest& manifest, size_t global_size) override {
    ESTUARY_RETURN_IF_ERROR(ValidateTask(task));
    if (task.optimizer != OptimizerKind::kSgd) {
      return InvalidArgument("task: model '{}' trains with sgd, not {}", task.model, OptimizerName(task.optimizer));
    }
    if (task.update_kind != UpdateKind::kFull) {
      return InvalidArgument("task: update kind lora needs a model with adapters; '{}' has none", task.model);
    }
    if (data_->size() == 0) return FailedPrecondition("trainer: no local examples");
    ESTUARY_ASSIGN_OR_RETURN(RankClassifier * model, ModelFor(task));
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
    ESTUARY_ASSIGN_OR_RETURN(RankClassifier * model, ModelFor(task));
    ESTUARY_ASSIGN_OR_RETURN(auto dp, model->StartRound(comm_, global, task, options_));

    const int features = data_->feature_size;
    std::vector<float> x(size_t(task.batch_size) * features);
    std::vector<int32_t> y(task.batch_size);

    double epoch_loss = 0;  // this rank's share of the last epoch's loss sum
    uint64_t epoch_examples = 0;
    std::vector<uint32_t> order(data_->size());
    std::iota(order.begin(), order.end(), 0u);
    BatchSchedule schedule(std::move(order), task, round, client_name);  // ClassifierTrainer's, on every rank
    while (schedule.Next()) {
      if (schedule.starts_epoch()) epoch_loss = 0, epoch_examples = 0;
      const RankRows rows = RowsOf(schedule.batch(), comm_);
      for (size_t i = 0; i < rows.items.size(); ++i) {
        std::memcpy(x.data() + i * features, data_->row(rows.items[i]), features * sizeof(float));
        y[i] = data_->labels[rows.items[i]];
      }
      ESTUARY_ASSIGN_OR_RETURN(const float loss, model->ForwardBackward(x.data(), y.data(), int(rows.items.size()),
                                                                        dp->MicroBatch(rows.weight, true)));
      ESTUARY_RETURN_IF_ERROR(
          dp->Step([&](std::span<const models::ParameterSlice> s) { model->OptimizerStep(s); }).status());
      ESTUARY_RETURN_IF_ERROR(model->FinishStep());
      epoch_loss += double(loss) * double(rows.examples);
      epoch_examples += schedule.batch().size();  // the whole global batch: every rank counts the same
    }
    return state_.Finish(std::move(dp), epoch_loss, double(epoch_examples));
  }

 private:
  Result<RankClassifier*> ModelFor(const TaskConfig& task) {
    if (!model_ || model_name_ != task.model || model_batch_ != int(task.batch_size)) {
      model_.reset();
      ESTUARY_ASSIGN_OR_RETURN(model_, make_model_(task.model, int(task.batch_size)));
      model_name_ = task.model;
      model_batch_ = int(task.batch_size);
    }
    return model_.get();
  }

  comm::Communicator& comm_;
  std::shared_ptr<const models::Dataset> data_;
  parallel::DataParallelOptions options_;
  RankClassifierFactory make_model_;
  std::unique_ptr<RankClassifier> model_;
  std::string model_name_;
  int model_batch_ = 0;
  RoundState state_;
};

class TextRankTrainer : public RankTrainer {
 public:
  TextRankTrainer(comm::Communicator& comm, std::shared_ptr<const std::vector<int32_t>> tokens, parallel::DataParallelOptions options,
                  TextRankModels models)
      : comm_(comm), tokens_(std::move(tokens)), options_(options), models_(std::move(models)) {
    options_.broadcast_parameters = false;
  }

  uint64_t num_examples() const override { return tokens_->size(); }
  Status ReadOut(const std::function<Status(uint64_t, std::span<const float>)>& fn) override {
    return state_.ReadOut([&](parallel::DataParallel& dp) { return trained_->ReadOut(dp, fn); });
  }

  Status Check(const TaskConfig& task, const Manifest& manifest, size_t global_size) override {
    ESTUARY_RETURN_IF_ERROR(ValidateTask(task));
    if (!models::IsLanguageModel(task.model)) {
      return InvalidArgument("task: model '{}' is not a language model; this site holds text", task.model);
    }
    if (Windows(task) == 0) {
      return FailedPrecondition("trainer: {} local tokens hold no window of {} + 1", tokens_->size(), task.seq_len);
    }
    if (task.update_kind == UpdateKind::kLora) {
      if (options_.stage == parallel::ZeroStage::kZero3) {
        return InvalidArgument("task: update kind lora on a site under --zero 3: the adapters open no unit to "
                               "gather; run it with --zero 0, 1 or 2");
      }
      ESTUARY_ASSIGN_OR_RETURN(const LoraRound plan, PlanLoraRound(task, models_.lora_rank));
      ESTUARY_RETURN_IF_ERROR(CheckLoraGlobal(plan, task, manifest, global_size));
      return LoraDecoderFor(task, plan.site).status();
    }
    ESTUARY_ASSIGN_OR_RETURN(RankDecoder * decoder, DecoderFor(task));
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
    std::unique_ptr<parallel::DataParallel> dp;
    if (task.update_kind == UpdateKind::kLora) {
      ESTUARY_ASSIGN_OR_RETURN(plan_, PlanLoraRound(task, models_.lora_rank));
      ESTUARY_ASSIGN_OR_RETURN(const LoraStart start, StartLoraRound(*plan_, global, task, round, client_name));
      ESTUARY_ASSIGN_OR_RETURN(lora, LoraDecoderFor(task, plan_->site));
      ESTUARY_RETURN_IF_ERROR(lora->LoadBase(start.base(), start.dropout_seed));
      ESTUARY_ASSIGN_OR_RETURN(dp, lora->StartRound(comm_, start.adapter, task, options_));
      trained_ = lora;
    } else {
      plan_.reset();
      ESTUARY_ASSIGN_OR_RETURN(trained_, DecoderFor(task));
      ESTUARY_ASSIGN_OR_RETURN(dp, trained_->StartRound(comm_, global, task, options_));
    }
    RankDecoder& decoder = *trained_;

    const int seq = int(task.seq_len);
    std::vector<int32_t> inputs(size_t(task.batch_size) * seq), targets(inputs.size());

    double loss_sum = 0;  // this rank's share of the last epoch's loss sum
    uint64_t loss_tokens = 0;
    std::vector<uint32_t> order(Windows(task));
    std::iota(order.begin(), order.end(), 0u);
    BatchSchedule schedule(std::move(order), task, round, client_name);  // TextTrainer's, on every rank
    while (schedule.Next()) {
      if (schedule.starts_epoch()) loss_sum = 0, loss_tokens = 0;
      const RankRows rows = RowsOf(schedule.batch(), comm_);
      for (size_t b = 0; b < rows.items.size(); ++b) {
        const int32_t* window = tokens_->data() + size_t(rows.items[b]) * seq;
        std::memcpy(inputs.data() + b * seq, window, seq * sizeof(int32_t));
        std::memcpy(targets.data() + b * seq, window + 1, seq * sizeof(int32_t));
      }
      if (lora) lora->SetFirstRow(int64_t(rows.first) * seq);
      ESTUARY_ASSIGN_OR_RETURN(const float loss,
                               decoder.ForwardBackward(inputs.data(), targets.data(), int(rows.items.size()), seq,
                                                       dp->MicroBatch(rows.weight, true)));
      ESTUARY_RETURN_IF_ERROR(
          dp->Step([&](std::span<const models::ParameterSlice> s) { decoder.OptimizerStep(s); }).status());
      ESTUARY_RETURN_IF_ERROR(decoder.FinishStep());
      loss_sum += double(loss) * double(rows.examples) * seq;
      loss_tokens += schedule.batch().size() * seq;  // the whole global batch: every rank counts the same
    }
    return state_.Finish(std::move(dp), loss_sum, double(loss_tokens));
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
  uint64_t Windows(const TaskConfig& task) const {
    return tokens_->empty() ? 0 : (tokens_->size() - 1) / uint64_t(task.seq_len);
  }
  Result<RankDecoder*> DecoderFor(const TaskConfig& task) {
    if (!decoder_ || model_name_ != task.model || model_batch_ != int(task.batch_size)) {
      decoder_.reset();
      ESTUARY_ASSIGN_OR_RETURN(decoder_, models_.decoder(task.model, int(task.batch_size)));
      model_name_ = task.model;
      model_batch_ = int(task.batch_size);
    }
    return decoder_.get();
  }
  // One adapted model at a time: a new model, batch or adapter config replaces it.
  Result<RankLoraDecoder*> LoraDecoderFor(const TaskConfig& task, const models::LoraConfig& config) {
    const std::string key = fmt::format("{}/{}/{}", task.model, task.batch_size, LoraConfigKey(config));
    if (!lora_decoder_ || lora_key_ != key) {
      lora_decoder_.reset();
      lora_key_.clear();
      ESTUARY_ASSIGN_OR_RETURN(auto made, models_.lora_decoder(task.model, int(task.batch_size), config));
      ESTUARY_RETURN_IF_ERROR(made->KeepBaseIn(models_.lora_base));
      lora_decoder_ = std::move(made);
      lora_key_ = key;
    }
    return lora_decoder_.get();
  }

  comm::Communicator& comm_;
  std::shared_ptr<const std::vector<int32_t>> tokens_;
  parallel::DataParallelOptions options_;
  TextRankModels models_;
  std::unique_ptr<RankDecoder> decoder_;
  std::string model_name_;
  int model_batch_ = 0;
  std::unique_ptr<RankLoraDecoder> lora_decoder_;
  std::string lora_key_;
  RankDecoder* trained_ = nullptr;  // the round's model: decoder_ or lora_decoder_
  std::optional<LoraRound> plan_;   // a lora round's
  RoundState state_;
};

// A CPU rank's model (models::Llama, models::Model) with the site's host
// optimizers, stepping whatever slices DataParallel hands them.
template <typename Model, typename Base>
class CpuRankModel : public Base {
 public:
  const Manifest& manifest() const override { return model().manifest(); }
  Result<std::unique_ptr<parallel::DataParallel>> StartRound(comm::Communicator& comm, std::span<const float> global,
                                                   const TaskConfig& task,
                                                   const parallel::DataParallelOptions& options) override {
    optimizer_.emplace(task);
    return client::StartRound(comm, model(), global, task, options);
  }
  void OptimizerStep(std::span<const models::ParameterSlice> slices) override { optimizer_->Step(slices); }
  Status FinishStep() override { return Status::Ok(); }
  Status ReadOut(parallel::DataParallel& dp, const std::function<Status(uint64_t, std::span<const float>)>& fn) override {
    return dp.ForEachSlice(fn);
  }

 protected:
  virtual Model& model() = 0;
  virtual const Model& model() const = 0;

 private:
  std::optional<RoundOptimizer> optimizer_;
};

class CpuRankDecoder : public CpuRankModel<models::Llama, RankDecoder> {
 public:
  explicit CpuRankDecoder(models::Llama model) : model_(std::move(model)) {}
  int max_seq_len() const override { return model_.config().max_seq_len; }
  Result<float> ForwardBackward(const int32_t* tokens, const int32_t* targets, int batch, int seq,
                                const models::BackwardOptions& options) override {
    return model_.ForwardBackward(tokens, targets, batch, seq, options);
  }

 private:
  models::Llama& model() override { return model_; }
  const models::Llama& model() const override { return model_; }
  models::Llama model_;
};

class CpuRankClassifier : public CpuRankModel<models::Model, RankClassifier> {
 public:
  explicit CpuRankClassifier(std::unique_ptr<models::Model> model) : model_(std::move(model)) {}
  int input_size() const override { return model_->input_size(); }
  Result<float> ForwardBackward(const float* x, const int32_t* y, int n,
                                const models::BackwardOptions& options) override {
    return model_->ForwardBackward(x, y, n, options);
  }

 private:
  models::Model& model() override { return *model_; }
  const models::Model& model() const override { return *model_; }
  std::unique_ptr<models::Model> model_;
};

class CpuRankLoraDecoder : public CpuRankModel<models::LoraLlama, RankLoraDecoder> {
 public:
  explicit CpuRankLoraDecoder(models::LoraLlama model) : model_(std::move(model)) {}
  int max_seq_len() const override { return model_.base().config().max_seq_len; }
  const models::LoraConfig& lora_config() const override { return model_.lora_config(); }

  Status KeepBaseIn(DType dtype) override {
    if (dtype == DType::kF32 && !model_.base_in_bf16()) return Status::Ok();
    if (dtype == DType::kBF16) {
      if (!model_.base_in_bf16()) model_.StoreBaseInBf16();
      return Status::Ok();
    }
    return InvalidArgument("site: a frozen base in {} on the CPU (f32 or bf16, chosen once)",
                           DTypeName(dtype));
  }
  Status LoadBase(std::span<const float> base, uint64_t dropout_seed) override {
    ESTUARY_RETURN_IF_ERROR(model_.LoadBase(base));
    model_.SeedDropout(dropout_seed);
    return Status::Ok();
  }
  void SetFirstRow(int64_t row) override { model_.SetDropoutFirstRow(row); }

  Result<std::unique_ptr<parallel::DataParallel>> StartRound(comm::Communicator& comm, std::span<const float> global,
                                                   const TaskConfig& task,
                                                   const parallel::DataParallelOptions& options) override {
    ESTUARY_ASSIGN_OR_RETURN(auto dp, CpuRankModel::StartRound(comm, global, task, options));
    frozen_.Start(task, global);
    return dp;
  }
  Status FinishStep() override {
    return frozen_.Restore(model_.manifest(), [&](uint64_t offset, std::span<const float> a) {
      std::copy(a.begin(), a.end(), model_.parameters().begin() + offset);
      return Status::Ok();
    });
  }
  Result<float> ForwardBackward(const int32_t* tokens, const int32_t* targets, int batch, int seq,
                                const models::BackwardOptions& options) override {
    return model_.ForwardBackward(tokens, targets, batch, seq, options);
  }

 private:
  models::LoraLlama& model() override { return model_; }
  const models::LoraLlama& model() const override { return model_; }
  models::LoraLlama model_;
  FrozenA frozen_;
};

// ---- what rank 0 tells the others -------------------------------------------

// Every message starts with a header of this size; a round's header is
// followed by its description (bytes) and the global weights (floats).
enum Kind : uint32_t { kIdle = 1, kRound = 2, kDone = 3, kAbort = 4 };
constexpr uint32_t kMagic = 0x45535452;  // "ESTR": a follower built from another binary fails at once
struct Header {
  uint32_t magic = kMagic;
  uint32_t kind = kIdle;
  uint64_t length = 0;  // bytes that follow
};
static_assert(sizeof(Header) == 16);

// A round as bytes: little-endian fields, strings with a length. Both ends are
// the same binary, so this is a private format, checked only for truncation.
class Writer {
 public:
  template <typename T>
  void Put(T value) {
    const auto* p = reinterpret_cast<const std::byte*>(&value);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  void Put(std::string_view s) {
    Put(uint64_t(s.size()));
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    bytes_.insert(bytes_.end(), p, p + s.size());
  }
  std::vector<std::byte>& bytes() { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::byte> bytes) : bytes_(bytes) {}
  template <typename T>
  bool Get(T* value) {
    if (bytes_.size() - at_ < sizeof(T)) return false;
    std::memcpy(value, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return true;
  }
  bool Get(std::string* s) {
    uint64_t size = 0;
    if (!Get(&size) || bytes_.size() - at_ < size) return false;
    s->assign(reinterpret_cast<const char*>(bytes_.data() + at_), size);
    at_ += size;
    return true;
  }

 private:
  std::span<const std::byte> bytes_;
  size_t at_ = 0;
};

struct RoundMessage {
  uint64_t round = 0;
  std::string client_name;
  TaskConfig task;
  uint64_t global_size = 0;
};

std::vector<std::byte> Encode(const RoundMessage& m) {
  Writer w;
  w.Put(m.round);
  w.Put(std::string_view(m.client_name));
  const TaskConfig& t = m.task;
  w.Put(std::string_view(t.model));
  w.Put(t.epochs);
  w.Put(t.batch_size);
  w.Put(t.learning_rate);
  w.Put(t.momentum);
  w.Put(t.weight_decay);
  w.Put(uint32_t(t.update_kind));
  w.Put(t.seed);
  w.Put(uint32_t(t.optimizer));
  w.Put(t.seq_len);
  w.Put(t.max_local_steps);
  w.Put(m.global_size);
  const LoraTask& l = t.lora;
  w.Put(int32_t(l.config.rank));
  w.Put(l.config.alpha);
  w.Put(l.config.dropout);
  w.Put(uint64_t(l.config.target_modules.size()));
  for (const std::string& module : l.config.target_modules) w.Put(std::string_view(module));
  w.Put(std::string_view(l.merge));
  w.Put(uint8_t(l.mixed_ranks));
  return std::move(w.bytes());
}

Result<RoundMessage> Decode(std::span<const std::byte> bytes) {
  Reader r(bytes);
  RoundMessage m;
  TaskConfig& t = m.task;
  uint32_t update_kind = 0, optimizer = 0;
  if (!(r.Get(&m.round) && r.Get(&m.client_name) && r.Get(&t.model) && r.Get(&t.epochs) && r.Get(&t.batch_size) &&
        r.Get(&t.learning_rate) && r.Get(&t.momentum) && r.Get(&t.weight_decay) && r.Get(&update_kind) &&
        r.Get(&t.seed) && r.Get(&optimizer) && r.Get(&t.seq_len) && r.Get(&t.max_local_steps) &&
        r.Get(&m.global_size))) {
    return ProtocolError("site: rank 0's round message of {} bytes is truncated", bytes.size());
  }
  LoraTask& l = t.lora;
  int32_t rank = 0;
  uint64_t modules = 0;
  uint8_t mixed_ranks = 0;
  bool ok = r.Get(&rank) && r.Get(&l.config.alpha) && r.Get(&l.config.dropout) && r.Get(&modules) &&
            modules <= bytes.size();
  l.config.target_modules.resize(ok ? modules : 0);
  for (std::string& module : l.config.target_modules) ok = ok && r.Get(&module);
  if (!(ok && r.Get(&l.merge) && r.Get(&mixed_ranks))) {
    return ProtocolError("site: rank 0's round message of {} bytes is truncated in its lora task", bytes.size());
  }
  l.config.rank = rank;
  l.mixed_ranks = mixed_ranks != 0;
  t.update_kind = UpdateKind(update_kind);
  t.optimizer = OptimizerKind(optimizer);
  return m;
}

}  // namespace

std::unique_ptr<RankTrainer> MakeClassifierRankTrainer(comm::Communicator& comm, std::shared_ptr<const models::Dataset> data,
                                                       parallel::DataParallelOptions options, RankClassifierFactory make_model) {
  if (!make_model) make_model = MakeCpuRankClassifier;
  return std::make_unique<ClassifierRankTrainer>(comm, std::move(data), options, std::move(make_model));
}

std::unique_ptr<RankTrainer> MakeTextRankTrainer(comm::Communicator& comm, std::shared_ptr<const std::vector<int32_t>> tokens,
                                                 parallel::DataParallelOptions options, TextRankModels models) {
  if (!models.decoder) models.decoder = MakeCpuRankDecoder;
  if (!models.lora_decoder) models.lora_decoder = MakeCpuRankLoraDecoder;
  return std::make_unique<TextRankTrainer>(comm, std::move(tokens), options, std::move(models));
}

size_t RankTrainer::TrainedSize(const TaskConfig&, size_t global_size) const { return global_size; }

Result<Update> RankTrainer::UpdateOf(std::vector<float> trained, std::span<const float> global,
                                     const Manifest& manifest, const TaskConfig&, double train_loss,
                                     std::chrono::steady_clock::time_point start, uint64_t round) {
  return FullUpdate(std::move(trained), global, manifest, num_examples(), train_loss, start, round);
}

Result<std::unique_ptr<RankDecoder>> MakeCpuRankDecoder(const std::string& model, int max_batch) {
  ESTUARY_ASSIGN_OR_RETURN(auto config, models::LlamaPreset(model));
  ESTUARY_ASSIGN_OR_RETURN(auto llama, models::Llama::Create(config, max_batch));
  return std::unique_ptr<RankDecoder>(std::make_unique<CpuRankDecoder>(std::move(llama)));
}

Result<std::unique_ptr<RankLoraDecoder>> MakeCpuRankLoraDecoder(const std::string& model, int max_batch,
                                                                const models::LoraConfig& lora) {
  ESTUARY_ASSIGN_OR_RETURN(auto config, models::LlamaPreset(model));
  ESTUARY_ASSIGN_OR_RETURN(auto base, models::Llama::Create(config, max_batch));
  ESTUARY_ASSIGN_OR_RETURN(auto adapted, models::LoraLlama::Create(std::move(base), lora));
  return std::unique_ptr<RankLoraDecoder>(std::make_unique<CpuRankLoraDecoder>(std::move(adapted)));
}

Result<std::unique_ptr<RankClassifier>> MakeCpuRankClassifier(const std::string& model, int) {
  ESTUARY_ASSIGN_OR_RETURN(auto cpu, models::MakeModel(model));
  return std::unique_ptr<RankClassifier>(std::make_unique<CpuRankClassifier>(std::move(cpu)));
}

#ifndef ESTUARY_HAVE_CUDA
Result<std::unique_ptr<RankDecoder>> MakeCudaRankDecoder(const std::string& model, int, const Compute& compute,
                                                         void*) {
  return FailedPrecondition("site: {} on {}: this build has no CUDA backend", model, compute.ToString());
}
Result<std::unique_ptr<RankClassifier>> MakeCudaRankClassifier(const std::string& model, int,
                                                               const Compute& compute, void*) {
  return FailedPrecondition("site: {} on {}: this build has no CUDA backend", model, compute.ToString());
}
Result<std::unique_ptr<RankLoraDecoder>> MakeCudaRankLoraDecoder(const std::string& model, int,
                                                                 const models::LoraConfig&, const Compute& compute,
                                                                 void*) {
  return FailedPrecondition("site: {} with LoRA on {}: this build has no CUDA backend", model, compute.ToString());
}
#endif

// ---- rank 0 -------------------------------------------------------------------

SiteTrainer::SiteTrainer(comm::Communicator& comm, std::unique_ptr<RankTrainer> rank, parallel::ZeroStage stage)
    : comm_(comm), rank_(std::move(rank)), stage_(stage) {}

void SiteTrainer::RunPending() {
  if (pending_ && !pending_->started()) {
    pending_->Cancel();
    pending_->Run();
  }
  pending_.reset();
}

Status SiteTrainer::SendHeader(uint32_t kind, uint64_t length) {
  Header header{kMagic, kind, length};
  return Await(comm_.Broadcast(std::as_writable_bytes(std::span<Header>(&header, 1)), 0));
}

Status SiteTrainer::Broken(Status status) {
  if (broken_.ok()) {
    broken_ = status;
    if (on_broken) on_broken(broken_);
  }
  return broken_;
}

Result<Update> SiteTrainer::Train(std::span<const float> global, const Manifest& manifest,
                                  const TaskConfig& task, uint64_t round, std::string_view client_name) {
  RunPending();
  ESTUARY_RETURN_IF_ERROR(broken_);
  if (finished_) return FailedPrecondition("site: the federation is over");
  // A task this site cannot train fails here, before the other ranks hear of
  // it, like a task a single process cannot train: the site carries on.
  ESTUARY_RETURN_IF_ERROR(rank_->Check(task, manifest, global.size()));
  const auto start = std::chrono::steady_clock::now();
  auto message = Encode({round, std::string(client_name), task, global.size()});
  // The broadcast's source (Broadcast takes a mutable span), then the round's
  // global weights for the delta.
  std::vector<float> source(global.begin(), global.end());
  if (Status s = SendHeader(kRound, message.size()); !s.ok()) return Broken(s);
  if (Status s = Await(comm_.Broadcast(std::span<std::byte>(message), 0)); !s.ok()) return Broken(s);
  if (Status s = Await(comm_.Broadcast(std::span<float>(source), 0)); !s.ok()) return Broken(s);
  // After the broadcast the others are in this round too: any failure leaves
  // them somewhere in it, so the site cannot go on.
  Result<double> loss = rank_->TrainRound(source, task, round, client_name);
  if (!loss.ok()) return Broken(loss.status());

  if (stage_ != parallel::ZeroStage::kZero3) {  // a lora round never runs under ZeRO-3 (Check)
    std::vector<float> trained(rank_->TrainedSize(task, global.size()));
    Status read = rank_->ReadOut([&](uint64_t offset, std::span<const float> values) {
      if (offset > trained.size() || values.size() > trained.size() - offset) {
        return Internal("site: trained values [{}, {}) overrun the {} expected", offset, offset + values.size(),
                        trained.size());
      }
      std::copy(values.begin(), values.end(), trained.begin() + offset);
      return Status::Ok();
    });
    if (!read.ok()) return Broken(read);
    return rank_->UpdateOf(std::move(trained), global, manifest, task, *loss, start, round);
  }

  // ZeRO-3: the delta leaves unit by unit, as the Agent uploads it.
  auto stream = std::make_shared<UpdateStream>(
      [this, global = std::move(source)](UpdateStream& out) {
        Status cancelled;
        Status read = rank_->ReadOut([&](uint64_t offset, std::span<const float> values) {
          UpdateStream::Slice slice{offset, std::vector<float>(values.begin(), values.end())};
          for (size_t i = 0; i < values.size(); ++i) slice.values[i] -= global[offset + i];
          cancelled = out.Push(std::move(slice));
          return cancelled;
        });
        // A cancelled stream (the connection dropped) fails on this rank only,
        // after every gather ran; anything else is a collective failure.
        if (!read.ok() && read.message() != cancelled.message()) return Broken(read);
        return read;
      });
  pending_ = stream;
  Result<Update> trained = TrainedUpdate(UpdateKind::kFull, rank_->num_examples(), *loss, round);
  if (!trained.ok()) {
    RunPending();  // the other ranks are in the read-out; end it with them
    return trained.status();
  }
  Update update = std::move(trained).value();
  update.manifest = manifest;
  update.stream = std::move(stream);
  update.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return update;
}

Status SiteTrainer::KeepAlive() {
  // While an update streams the others are in its gathers, not waiting for a header.
  if (finished_ || (pending_ && !pending_->started())) return Status::Ok();
  ESTUARY_RETURN_IF_ERROR(broken_);
  if (Status s = SendHeader(kIdle, 0); !s.ok()) return Broken(s);
  return Status::Ok();
}

Status SiteTrainer::Finish(const Status& outcome) {
  if (finished_) return Status::Ok();
  RunPending();
  finished_ = true;
  ESTUARY_RETURN_IF_ERROR(broken_);
  if (outcome.ok()) return SendHeader(kDone, 0);
  std::string reason = outcome.message();
  ESTUARY_RETURN_IF_ERROR(SendHeader(kAbort, reason.size()));
  return Await(comm_.Broadcast(std::as_writable_bytes(std::span<char>(reason)), 0));
}

// ---- every other rank ---------------------------------------------------------

Status RunFollower(comm::Communicator& comm, RankTrainer& rank) {
  std::vector<float> global;
  for (;;) {
    Header header;
    ESTUARY_RETURN_IF_ERROR(Await(comm.Broadcast(std::as_writable_bytes(std::span<Header>(&header, 1)), 0)));
    if (header.magic != kMagic) return ProtocolError("site rank {}: rank 0 sent a header without the site's magic", comm.rank());
    std::vector<std::byte> bytes(header.length);
    if (header.length > 0) ESTUARY_RETURN_IF_ERROR(Await(comm.Broadcast(std::span<std::byte>(bytes), 0)));
    switch (header.kind) {
      case kIdle: continue;
      case kDone: return Status::Ok();
      case kAbort:
        return Aborted("site rank {}: rank 0 gave up: {}", comm.rank(),
                       std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
      case kRound: break;
      default: return ProtocolError("site rank {}: unknown message kind {} from rank 0", comm.rank(), header.kind);
    }
    ESTUARY_ASSIGN_OR_RETURN(RoundMessage m, Decode(bytes));
    global.resize(m.global_size);
    ESTUARY_RETURN_IF_ERROR(Await(comm.Broadcast(std::span<float>(global), 0)));
    spdlog::debug("site rank {}: round {} for {}", comm.rank(), m.round, m.client_name);
    auto loss = rank.TrainRound(global, m.task, m.round, m.client_name);
    if (!loss.ok()) return loss.status();
    ESTUARY_RETURN_IF_ERROR(rank.ReadOut([](uint64_t, std::span<const float>) { return Status::Ok(); }));
  }
}

}  // namespace estuary::client
