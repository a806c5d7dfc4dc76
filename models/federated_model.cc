#include "models/federated_model.h"

#include "models/dataset.h"
#include "models/language_model.h"
#include "models/text_corpus.h"

namespace estuary::models {

namespace {

class ClassifierEvaluator : public Evaluator {
 public:
  ClassifierEvaluator(std::vector<std::unique_ptr<Model>> replicas, Dataset test)
      : replicas_(std::move(replicas)), test_(std::move(test)) {}
  Result<EvalResult> Evaluate(std::span<const float> global) override {
    if (global.size() != replicas_.front()->parameters().size()) {
      return InvalidArgument("eval: {} parameters for a model of {}", global.size(),
                             replicas_.front()->parameters().size());
    }
    return EvaluateParallel(replicas_, global, test_.features.data(), test_.labels.data(), test_.size());
  }

 private:
  std::vector<std::unique_ptr<Model>> replicas_;
  Dataset test_;
};

class LanguageModelEvaluator : public Evaluator {
 public:
  LanguageModelEvaluator(Llama model, std::vector<int32_t> held_out, int seq, uint64_t windows)
      : model_(std::move(model)), held_out_(std::move(held_out)), seq_(seq), windows_(windows) {}
  Result<EvalResult> Evaluate(std::span<const float> global) override {
    return EvaluateLanguageModel(model_, global, held_out_, seq_, windows_);
  }

 private:
  Llama model_;
  std::vector<int32_t> held_out_;
  int seq_;
  uint64_t windows_;
};

class RowsEvaluator : public Evaluator {
 public:
  RowsEvaluator(Llama model, TokenRows rows, uint64_t max_rows)
      : model_(std::move(model)), rows_(std::move(rows)), max_rows_(max_rows) {}
  Result<EvalResult> Evaluate(std::span<const float> global) override {
    return EvaluateLanguageModelRows(model_, global, rows_, max_rows_);
  }

 private:
  Llama model_;
  TokenRows rows_;
  uint64_t max_rows_;
};

}  // namespace

Result<std::unique_ptr<Evaluator>> MakeRowsEvaluator(std::string_view model, TokenRows rows, uint64_t max_rows) {
  ESTUARY_ASSIGN_OR_RETURN(const LlamaConfig config, LlamaPreset(model));
  if (rows.seq_len <= 0 || rows.seq_len > config.max_seq_len) {
    return InvalidArgument("eval: seq_len {} not in [1, {}] for {}", rows.seq_len, config.max_seq_len, model);
  }
  ESTUARY_ASSIGN_OR_RETURN(Llama replica, Llama::Create(config, 8));
  return std::unique_ptr<Evaluator>(new RowsEvaluator(std::move(replica), std::move(rows), max_rows));
}

Result<InitialWeights> InitialModel(std::string_view name, uint64_t seed) {
  InitialWeights weights;
  if (IsLanguageModel(name)) {
    ESTUARY_ASSIGN_OR_RETURN(const LlamaConfig config, LlamaPreset(name));
    ESTUARY_ASSIGN_OR_RETURN(Llama model, Llama::Create(config, 1));
    model.Initialize(seed);
    weights.manifest = model.manifest();
    weights.values.assign(model.parameters().begin(), model.parameters().end());
    return weights;
  }
  ESTUARY_ASSIGN_OR_RETURN(auto model, MakeModel(name));
  model->Initialize(seed);
  weights.manifest = model->manifest();
  weights.values.assign(model->parameters().begin(), model->parameters().end());
  return weights;
}

Result<std::unique_ptr<Evaluator>> MakeEvaluator(std::string_view model, const std::filesystem::path& data,
                                                 const EvaluatorOptions& options) {
  if (IsLanguageModel(model)) {
    ESTUARY_ASSIGN_OR_RETURN(const LlamaConfig config, LlamaPreset(model));
    if (options.seq_len <= 0 || options.seq_len > config.max_seq_len) {
      return InvalidArgument("eval: seq_len {} not in [1, {}] for {}", options.seq_len, config.max_seq_len, model);
    }
    ESTUARY_ASSIGN_OR_RETURN(auto sources,
                             LoadFortunes(data, {.test_fraction = 0.1, .seed = options.seed,
                                                 .min_tokens = uint64_t(options.seq_len) + 1}));
    std::vector<int32_t> held_out;
    for (const auto& source : sources) held_out.insert(held_out.end(), source.test.begin(), source.test.end());
    ESTUARY_ASSIGN_OR_RETURN(Llama replica, Llama::Create(config, 8));
    return std::unique_ptr<Evaluator>(
        new LanguageModelEvaluator(std::move(replica), std::move(held_out), options.seq_len, options.max_windows));
  }
  ESTUARY_ASSIGN_OR_RETURN(Dataset test, LoadIdx(data, Split::kTest));
  std::vector<std::unique_ptr<Model>> replicas;
  for (int i = 0; i < std::max(1, options.threads); ++i) {
    ESTUARY_ASSIGN_OR_RETURN(auto replica, MakeModel(model));
    replicas.push_back(std::move(replica));
  }
  if (test.feature_size != replicas.front()->input_size()) {
    return InvalidArgument("{}: examples have {} features, model '{}' wants {}", data.string(), test.feature_size, model,
                           replicas.front()->input_size());
  }
  return std::unique_ptr<Evaluator>(new ClassifierEvaluator(std::move(replicas), std::move(test)));
}

}  // namespace estuary::models
