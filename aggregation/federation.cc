#include "aggregation/federation.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/message.h>
#include <google/protobuf/text_format.h>

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "aggregation/robust_strategy.h"
#include "base/atomic_file.h"
#include "models/hf_base.h"
#include "models/instruction_set.h"
#include "models/llama.h"
#include "models/language_model.h"
#include "models/lora_federation.h"
#include "proto/task.h"

namespace estuary::aggregation {

v1::FederationConfig DefaultFederation() {
  v1::FederationConfig config;
  v1::TaskConfig& task = *config.mutable_task();
  task.set_model("mlp");
  task.set_epochs(5);
  task.set_batch_size(10);
  task.set_learning_rate(0.05f);
  task.set_update_kind(v1::UPDATE_FULL);
  task.set_seed(2017);
  task.set_optimizer("sgd");
  task.set_seq_len(128);
  v1::LoraTask& lora = *task.mutable_lora();
  lora.set_rank(8);
  lora.set_alpha(16);
  for (const char* module : {"q_proj", "k_proj", "v_proj", "o_proj"}) lora.add_target_modules(module);
  lora.set_merge("exact");
  const StrategyOptions strategy;
  v1::StrategyConfig& s = *config.mutable_strategy();
  s.set_name(strategy.name);
  // server_lr stays 0: each strategy's own default (DefaultServerLr).
  s.set_server_momentum(strategy.server_momentum);
  s.set_beta1(strategy.beta1);
  s.set_beta2(strategy.beta2);
  s.set_tau(strategy.tau);
  s.set_trim(strategy.trim);
  s.set_byzantine(strategy.byzantine);
  config.set_eval_windows(256);
  // An update ten times the last round's median is an outlier no honest site
  // sends; bounding it costs an honest federation nothing.
  config.mutable_limits()->set_max_norm_over_median(10);
  // DP off (noise multiplier 0); the rest are Andrew et al.'s and common
  // practice's starting points, used once a noise multiplier is given.
  v1::DpConfig& dp = *config.mutable_dp();
  dp.set_clip(1.0);
  dp.set_target_quantile(0.5);
  dp.set_clip_lr(0.2);
  dp.set_delta(1e-5);
  return config;
}

StrategyOptions StrategyOptionsOf(const v1::StrategyConfig& c) {
  return {.name = c.name(),
          .server_lr = c.server_lr() != 0 ? c.server_lr() : DefaultServerLr(c.name()),
          .beta1 = c.beta1(),
          .beta2 = c.beta2(),
          .tau = c.tau(),
          .server_momentum = c.server_momentum(),
          .trim = c.trim(),
          .byzantine = c.byzantine(),
          .krum_select = c.krum_select(),
          .total_sites = c.total_sites()};
}

models::LoraConfig LoraConfigOf(const v1::TaskConfig& task) {
  const v1::LoraTask& l = task.lora();
  models::LoraConfig lora;
  lora.rank = int(std::min<uint32_t>(l.rank(), 1u << 20));
  lora.alpha = l.alpha();
  lora.dropout = l.dropout();
  lora.target_modules.assign(l.target_modules().begin(), l.target_modules().end());
  lora.base_model_name_or_path = task.model();
  return lora;
}

DpOptions DpOptionsOf(const v1::DpConfig& dp) {
  return {.noise_multiplier = dp.noise_multiplier(),
          .clip = dp.clip(),
          .adaptive = dp.adaptive_clip(),
          .target_quantile = dp.target_quantile(),
          .clip_lr = dp.clip_lr(),
          .clipped_count_stddev = dp.clipped_count_stddev()};
}

namespace {

Status CheckDp(const v1::FederationConfig& config) {
  const v1::DpConfig& dp = config.dp();
  // Nonsense is refused whether or not DP is on; what must be positive only
  // once it is (a config built field by field leaves them 0).
  auto at_least_zero = [](const char* key, double value) -> Status {
    if (!(value >= 0) || !std::isfinite(value)) {
      return InvalidArgument("federation: {} = {}: must be a finite number >= 0", key, value);
    }
    return Status::Ok();
  };
  ESTUARY_RETURN_IF_ERROR(at_least_zero("dp_noise_multiplier", dp.noise_multiplier()));
  ESTUARY_RETURN_IF_ERROR(at_least_zero("dp_clip", dp.clip()));
  ESTUARY_RETURN_IF_ERROR(at_least_zero("dp_clip_lr", dp.clip_lr()));
  ESTUARY_RETURN_IF_ERROR(at_least_zero("dp_clipped_count_stddev", dp.clipped_count_stddev()));
  ESTUARY_RETURN_IF_ERROR(at_least_zero("dp_max_epsilon", dp.max_epsilon()));
  if (!(dp.target_quantile() >= 0 && dp.target_quantile() <= 1)) {
    return InvalidArgument("federation: dp_target_quantile = {}: must be in [0, 1]", dp.target_quantile());
  }
  if (!(dp.delta() >= 0 && dp.delta() < 1)) {
    return InvalidArgument("federation: dp_delta = {}: must be in (0, 1)", dp.delta());
  }
  if (dp.noise_multiplier() > 0 && IsRobustStrategy(config.strategy().name())) {
    // DP-FedAvg's noise is calibrated to a clipped sum's sensitivity, not to a robust rule's.
    return InvalidArgument("federation: dp_noise_multiplier = {} with strategy = {}: DP-FedAvg noises a clipped "
                           "mean, not a robust rule",
                           dp.noise_multiplier(), config.strategy().name());
  }
  if (dp.noise_multiplier() > 0 && (config.strategy().name() == "fednova" || config.strategy().name() == "scaffold")) {
    // DP-FedAvg folds one noised mean into its inner strategy: no site's
    // local work or control delta is left to fold.
    return InvalidArgument("federation: dp_noise_multiplier = {} with strategy = {}: DP-FedAvg hands on one noised "
                           "mean, {} needs each site's update with its {}",
                           dp.noise_multiplier(), config.strategy().name(), config.strategy().name(),
                           config.strategy().name() == "fednova" ? "local steps" : "control delta");
  }
  if (dp.noise_multiplier() == 0) {
    if (dp.adaptive_clip() || dp.max_epsilon() > 0) {
      return InvalidArgument("federation: dp_{} without dp_noise_multiplier: differential privacy is off",
                             dp.adaptive_clip() ? "adaptive_clip" : "max_epsilon");
    }
    return Status::Ok();
  }
  if (dp.clip() == 0) return InvalidArgument("federation: dp_clip = 0: must be > 0 with dp_noise_multiplier");
  if (dp.delta() == 0) return InvalidArgument("federation: dp_delta = 0: must be in (0, 1)");
  // The count's noise must leave the sum a finite share of the budget (dp_fedavg.h).
  if (dp.adaptive_clip() && dp.clipped_count_stddev() > 0 && !(dp.noise_multiplier() < 2 * dp.clipped_count_stddev())) {
    return InvalidArgument("federation: dp_clipped_count_stddev = {}: must be above dp_noise_multiplier / 2 = {} "
                           "with dp_adaptive_clip",
                           dp.clipped_count_stddev(), dp.noise_multiplier() / 2);
  }
  if (config.task().update_kind() == v1::UPDATE_LORA && config.task().lora().mixed_ranks()) {
    return InvalidArgument("federation: dp_noise_multiplier = {} with lora_mixed_ranks: adapters of different "
                           "ranks cannot be summed coordinate by coordinate",
                           dp.noise_multiplier());
  }
  return Status::Ok();
}

}  // namespace

Status CheckFederation(const v1::FederationConfig& config) {
  ESTUARY_RETURN_IF_ERROR(CheckDp(config));
  const v1::TaskConfig& task = config.task();
  if (Status valid = proto::CheckTask(task); !valid.ok()) return InvalidArgument("federation: {}", valid.message());
  if (config.eval_windows() == 0) return InvalidArgument("federation: eval_windows = 0: must be >= 1");
  const v1::UpdateLimits& limits = config.limits();
  if (!(limits.max_norm() >= 0) || !std::isfinite(limits.max_norm())) {
    return InvalidArgument("federation: max_update_norm = {}: must be a number >= 0 (0: none)", limits.max_norm());
  }
  if (!(limits.max_norm_over_median() >= 0) || !std::isfinite(limits.max_norm_over_median())) {
    return InvalidArgument("federation: max_norm_over_median = {}: must be a number >= 0 (0: none)",
                           limits.max_norm_over_median());
  }
  if (!config.initial_model().empty()) {
    // The file is the model: no preset, no base, no adapters.
    if (task.update_kind() != v1::UPDATE_FULL) {
      return InvalidArgument("federation: initial_model = {} with update_kind = lora: a model known only as a file "
                             "trains full updates",
                             config.initial_model());
    }
    if (!config.base_model().empty()) {
      return InvalidArgument("federation: initial_model = {} with base_model = {}: give one of them",
                             config.initial_model(), config.base_model());
    }
  }
  std::optional<models::LlamaConfig> hf_config;
  if (const std::filesystem::path base(config.base_model()); !base.empty()) {
    std::error_code error;
    if (std::filesystem::is_directory(base, error)) {
      if (!models::IsHfModelDir(base)) {
        return InvalidArgument("federation: base_model = {}: a directory without config.json (a Hugging Face base "
                               "is a model directory: config.json and model.safetensors)",
                               config.base_model());
      }
      auto read = models::ReadHfConfig(base);
      if (!read.ok()) return InvalidArgument("federation: base_model = {}: {}", config.base_model(),
                                             read.status().message());
      hf_config = *read;
    }
  }
  if (task.update_kind() == v1::UPDATE_LORA) {
    if (limits.max_norm() > 0) {
      return InvalidArgument("federation: max_update_norm = {} with update_kind = lora: norm bounds apply to full "
                             "updates; adapters are bounded by their shapes",
                             limits.max_norm());
    }
    if (config.strategy().name() != "fedavg") {
      // The adapters merge by the task's rule; a server optimizer over them is not built.
      return InvalidArgument("federation: strategy = {} with update_kind = lora: a lora federation merges its "
                             "adapters by lora_merge (naive | exact | frozen-a), not by a server optimizer",
                             config.strategy().name());
    }
    return (hf_config ? LoraOptionsOf(task, *hf_config) : LoraOptionsOf(task)).status();
  }
  if (!config.base_model().empty() && !hf_config) {
    // A preset's safetensors file is a lora federation's base; a full one
    // starts from a Hugging Face model directory.
    return InvalidArgument("federation: base_model = {}: only a lora federation starts from a base model file (a "
                           "full one takes a Hugging Face model directory)",
                           config.base_model());
  }
  if (Status valid = ValidateStrategyOptions(StrategyOptionsOf(config.strategy())); !valid.ok()) {
    return InvalidArgument("federation: {}", valid.message());
  }
  return Status::Ok();
}

Result<LoraStrategyOptions> LoraOptionsOf(const v1::TaskConfig& task) {
  if (!models::IsLanguageModel(task.model())) {
    return InvalidArgument("federation: update_kind = lora needs a language model (llama-*), not '{}'", task.model());
  }
  ESTUARY_ASSIGN_OR_RETURN(const models::LlamaConfig model, models::LlamaPreset(task.model()));
  return LoraOptionsOf(task, model);
}

Result<LoraStrategyOptions> LoraOptionsOf(const v1::TaskConfig& task, const models::LlamaConfig& model) {
  const models::LoraConfig lora = LoraConfigOf(task);
  if (Status valid = lora.Validate(); !valid.ok()) return InvalidArgument("federation: {}", valid.message());
  LoraStrategyOptions options;
  auto rule = ParseLoraMergeRule(task.lora().merge());
  if (!rule.ok()) {
    return InvalidArgument("federation: lora_merge = '{}': {}", task.lora().merge(), rule.status().message());
  }
  options.merge.rule = *rule;
  options.merge.rank = size_t(lora.rank);
  options.merge.alpha = lora.alpha;
  options.mixed_ranks = task.lora().mixed_ranks();
  ESTUARY_ASSIGN_OR_RETURN(options.layout, models::MakeLoraGlobalLayout(model, lora));
  if (Status valid = ValidateLoraStrategyOptions(options); !valid.ok()) {
    return InvalidArgument("federation: {}", valid.message());
  }
  return options;
}

namespace {

// The first syntax error, as "LINE:COLUMN: message".
class FirstError : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, google::protobuf::io::ColumnNumber column, const std::string& message) override {
    if (error.empty()) error = fmt::format("{}:{}: {}", line + 1, column + 1, message);
  }
  std::string error;
};

}  // namespace

namespace {

// The first floating-point field of `message` (set, at any depth) that is not
// finite, as "path.to.field = value"; empty when there is none. No setting
// means anything as NaN or infinity, and the text format would not even
// write a NaN's sign back.
std::string FirstNonFiniteNumber(const google::protobuf::Message& message, const std::string& prefix) {
  const google::protobuf::Reflection* reflection = message.GetReflection();
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  reflection->ListFields(message, &fields);
  for (const google::protobuf::FieldDescriptor* field : fields) {
    const std::string name = prefix.empty() ? field->name() : prefix + "." + field->name();
    const int count = field->is_repeated() ? reflection->FieldSize(message, field) : 1;
    for (int i = 0; i < count; ++i) {
      const std::string at = field->is_repeated() ? fmt::format("{}[{}]", name, i) : name;
      double value = 0;
      switch (field->cpp_type()) {
        case google::protobuf::FieldDescriptor::CPPTYPE_DOUBLE:
          value = field->is_repeated() ? reflection->GetRepeatedDouble(message, field, i)
                                       : reflection->GetDouble(message, field);
          break;
        case google::protobuf::FieldDescriptor::CPPTYPE_FLOAT:
          value = field->is_repeated() ? reflection->GetRepeatedFloat(message, field, i)
                                       : reflection->GetFloat(message, field);
          break;
        case google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE: {
          const google::protobuf::Message& inner = field->is_repeated()
                                                       ? reflection->GetRepeatedMessage(message, field, i)
                                                       : reflection->GetMessage(message, field);
          if (std::string found = FirstNonFiniteNumber(inner, at); !found.empty()) return found;
          continue;
        }
        default:
          continue;
      }
      if (!std::isfinite(value)) return fmt::format("{} = {}", at, value);
    }
  }
  return {};
}

}  // namespace

Result<v1::FederationConfig> ReadFederationFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) return IoError("federation: {}: cannot read it", path.string());
  std::stringstream text;
  text << in.rdbuf();
  v1::FederationConfig given;
  google::protobuf::TextFormat::Parser parser;
  FirstError errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(text.str(), &given)) {
    return InvalidArgument("federation: {}:{}", path.string(), errors.error);
  }
  if (std::string found = FirstNonFiniteNumber(given, ""); !found.empty()) {
    return InvalidArgument("federation: {}: {}; every number must be finite", path.string(), found);
  }
  v1::FederationConfig config = DefaultFederation();
  if (given.task().lora().target_modules_size() > 0) config.mutable_task()->mutable_lora()->clear_target_modules();
  config.MergeFrom(given);
  return config;
}

Status WriteFederationFile(const std::filesystem::path& path, const v1::FederationConfig& config) {
  std::string text;
  if (!google::protobuf::TextFormat::PrintToString(config, &text)) {
    return Internal("federation: cannot print the config for {}", path.string());
  }
  return WriteFileAtomically(path, text);
}

Result<std::shared_ptr<const models::HfBase>> ApplyHfBase(v1::FederationConfig* config) {
  if (!models::IsHfModelDir(config->base_model())) return std::shared_ptr<const models::HfBase>();
  auto base = models::LoadHfBase(config->base_model());
  if (!base.ok()) return InvalidArgument("federation: base_model = {}: {}", config->base_model(), base.status().message());
  // The task names the base and carries its shape and identity; the sites hold the weights.
  v1::TaskConfig& task = *config->mutable_task();
  task.set_model(base->ModelName());
  task.mutable_hf_base()->set_sha256(base->sha256);
  task.mutable_hf_base()->set_shape(base->shape);
  ESTUARY_RETURN_IF_ERROR(models::RegisterHfModel(task.model(), base->config));
  return std::make_shared<const models::HfBase>(std::move(base).value());
}

Result<std::shared_ptr<const models::CustomModel>> ApplyInitialModel(v1::FederationConfig* config) {
  if (config->initial_model().empty()) return std::shared_ptr<const models::CustomModel>();
  auto model = models::LoadCustomModel(config->initial_model());
  if (!model.ok()) return InvalidArgument("federation: initial_model = {}", model.status().message());
  config->mutable_task()->set_model(model->name);
  return std::make_shared<const models::CustomModel>(std::move(model).value());
}

namespace {

// A server's held-out instruction examples, rendered and packed as the sites
// render and pack theirs, so its loss is the one the sites train on.
Result<models::TokenRows> HeldOutInstructionRows(const v1::FederationConfig& config, const v1::TaskConfig& task,
                                                 const EvaluationOptions& evaluation) {
  std::filesystem::path tokenizer = evaluation.tokenizer;
  if (tokenizer.empty() && task.has_hf_base()) tokenizer = std::filesystem::path(config.base_model()) / "tokenizer.json";
  if (tokenizer.empty()) {
    return InvalidArgument("--eval-data {}: instruction data needs --tokenizer (the model's tokenizer.json)",
                           evaluation.data.string());
  }
  const std::string& name = task.prompt_template();
  ESTUARY_ASSIGN_OR_RETURN(const models::InstructionSet set,
                           models::LoadInstructionSet(evaluation.data, tokenizer, name.empty() ? "none" : name));
  ESTUARY_ASSIGN_OR_RETURN(const models::LlamaConfig model, models::LlamaPreset(task.model()));
  if (set.vocab_size > model.vocab_size) {
    return InvalidArgument("--eval-data {}: {}'s vocabulary of {} tokens does not hold the tokenizer's {} ({})",
                           evaluation.data.string(), task.model(), model.vocab_size, set.vocab_size,
                           tokenizer.string());
  }
  return models::PackForTraining(set, int(task.seq_len())).rows;
}

}  // namespace

Result<Federation> MakeFederation(const v1::FederationConfig& config, const EvaluationOptions& evaluation,
                                  DpNoise noise) {
  ESTUARY_RETURN_IF_ERROR(CheckFederation(config));
  Federation f;
  f.config = config;
  ESTUARY_ASSIGN_OR_RETURN(const std::shared_ptr<const models::HfBase> hf_base, ApplyHfBase(&f.config));
  const v1::TaskConfig& task = f.config.task();
  models::InitialWeights initial;
  if (task.update_kind() == v1::UPDATE_LORA) {
    ESTUARY_ASSIGN_OR_RETURN(f.lora, LoraOptionsOf(task));
    if (hf_base) {
      ESTUARY_ASSIGN_OR_RETURN(initial, models::LoraInitialModel(hf_base->config, LoraConfigOf(task), task.seed(),
                                                                 hf_base->weights));
      auto held = std::make_shared<std::vector<float>>(hf_base->weights);
      held->resize(initial.values.size(), 0.0f);
      f.held_base = std::move(held);
    } else {
      ESTUARY_ASSIGN_OR_RETURN(initial, models::LoraInitialModel(task.model(), LoraConfigOf(task), task.seed(),
                                                                 config.base_model()));
    }
    if (!(initial.manifest == f.lora->layout.global)) {
      return Internal("federation: the LoRA initial model's layout differs from the strategy's");
    }
    ESTUARY_ASSIGN_OR_RETURN(f.strategy, LoraStrategy::Make(*f.lora));
  } else {
    f.config.mutable_task()->clear_lora();  // what the sites are sent: no adapters in a full federation
    ESTUARY_ASSIGN_OR_RETURN(f.custom, ApplyInitialModel(&f.config));
    if (f.custom) {
      if (!evaluation.data.empty() || evaluation.rows) {
        return InvalidArgument("--eval-data {}: {} (--initial-model {}) is a model the server knows only as tensors; "
                               "it has no evaluator for it",
                               evaluation.data.string(), f.custom->name, config.initial_model());
      }
      initial = {f.custom->manifest, f.custom->values};
    } else if (hf_base) {
      // The global model starts as the base itself; every tensor a round
      // changes is what a site lacks, the rest it holds.
      initial = {.manifest = hf_base->manifest, .values = hf_base->weights};
      f.held_base = std::make_shared<const std::vector<float>>(hf_base->weights);
    } else {
      ESTUARY_ASSIGN_OR_RETURN(initial, models::InitialModel(task.model(), task.seed()));
    }
    ESTUARY_ASSIGN_OR_RETURN(f.strategy, MakeStrategy(StrategyOptionsOf(config.strategy())));
  }
  if (config.dp().noise_multiplier() > 0) {
    DpOptions dp = DpOptionsOf(config.dp());
    if (noise == DpNoise::kSeeded) dp.seed = task.seed();
    std::optional<DpUploadReference> reference;
    if (f.lora) {
      ESTUARY_ASSIGN_OR_RETURN(reference, LoraUploadReference(*f.lora));
    }
    f.strategy = std::make_unique<DpFedAvg>(std::move(f.strategy), std::move(dp), std::move(reference));
  }
  f.manifest = std::move(initial.manifest);
  f.initial = std::move(initial.values);
  f.bound = UpdateBound(config.limits());
  std::shared_ptr<const models::TokenRows> rows = evaluation.rows;
  if (!rows && std::filesystem::is_regular_file(evaluation.data)) {
    if (!models::IsLanguageModel(task.model())) {
      return InvalidArgument("--eval-data {}: a file of instruction examples, but {} is not a language model",
                             evaluation.data.string(), task.model());
    }
    ESTUARY_ASSIGN_OR_RETURN(models::TokenRows held, HeldOutInstructionRows(f.config, task, evaluation));
    rows = std::make_shared<const models::TokenRows>(std::move(held));
  }
  if (rows) {
    ESTUARY_ASSIGN_OR_RETURN(f.evaluator, models::MakeRowsEvaluator(task.model(), *rows, config.eval_windows()));
    if (f.lora) f.evaluator = models::MakeLoraEvaluator(std::move(f.evaluator), f.lora->layout, f.lora->merge.alpha);
  } else if (!evaluation.data.empty()) {
    ESTUARY_ASSIGN_OR_RETURN(f.evaluator, models::MakeEvaluator(task.model(), evaluation.data,
                                                                {.threads = evaluation.threads,
                                                                 .seq_len = int(task.seq_len()),
                                                                 .max_windows = config.eval_windows(),
                                                                 .seed = task.seed()}));
    if (f.lora) f.evaluator = models::MakeLoraEvaluator(std::move(f.evaluator), f.lora->layout, f.lora->merge.alpha);
  }
  return f;
}

}  // namespace estuary::aggregation
