// estuary::RunSite (include/estuary/client.h): the public Trainer behind the
// internal one, and the Agent run as estuary-client runs it.
#include "estuary/client.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <exception>
#include <map>

#include "base/asio.h"
#include "base/host_port.h"
#include "client/agent.h"
#include "client/trainer.h"
#include "client/local_work.h"
#include "crypto/tls.h"
#include "models/custom_model.h"

namespace estuary {
namespace {

TaskInfo TaskInfoOf(const v1::TaskConfig& task, uint64_t round, std::string_view site) {
  return {.model = task.model(),
          .round = round,
          .site = std::string(site),
          .epochs = task.epochs(),
          .batch_size = task.batch_size(),
          .learning_rate = task.learning_rate(),
          .momentum = task.momentum(),
          .weight_decay = task.weight_decay(),
          .optimizer = task.optimizer().empty() ? "sgd" : task.optimizer(),
          .max_local_steps = task.max_local_steps(),
          .max_local_seconds = task.max_local_seconds(),
          .proximal_mu = task.proximal_mu(),
          .seed = task.seed()};
}

// The user's tensors laid into the manifest's flat buffer: each by name,
// of the manifest's shape (a 0-d one may come back as 0-d), none missing,
// none unknown, none twice.
Result<std::vector<float>> Flatten(const std::vector<Tensor>& tensors, const Manifest& manifest, uint64_t round) {
  std::vector<float> flat(manifest.total_elements);
  std::map<std::string_view, const TensorSpec*> specs;
  for (const TensorSpec& spec : manifest.tensors) specs[spec.name] = &spec;
  for (const Tensor& t : tensors) {
    const auto it = specs.find(t.name);
    if (it == specs.end() && manifest.Find(t.name)) {
      return InvalidArgument("round {}: the trainer returned tensor '{}' twice", round, t.name);
    }
    if (it == specs.end()) {
      return InvalidArgument("round {}: the trainer returned tensor '{}', which the global model does not hold", round,
                             t.name);
    }
    const TensorSpec& spec = *it->second;
    const bool scalar = t.shape.empty() && spec.shape == std::vector<int64_t>{1};
    if (t.shape != spec.shape && !scalar) {
      return InvalidArgument("round {}: the trainer returned tensor '{}' of shape [{}], the global model's is [{}]",
                             round, t.name, fmt::join(t.shape, ", "), fmt::join(spec.shape, ", "));
    }
    if (t.data.size() != spec.numel()) {
      return InvalidArgument("round {}: the trainer returned {} values for tensor '{}' of {} elements", round,
                             t.data.size(), t.name, spec.numel());
    }
    std::copy(t.data.begin(), t.data.end(), flat.begin() + int64_t(spec.offset));
    specs.erase(it);
  }
  if (!specs.empty()) {
    return InvalidArgument("round {}: the trainer returned no tensor '{}' (and {} more)", round,
                           specs.begin()->first, specs.size() - 1);
  }
  return flat;
}

// The global model as named tensors, in the manifest's order.
std::vector<estuary::Tensor> Tensors(std::span<const float> global, const Manifest& manifest) {
  std::vector<estuary::Tensor> tensors;
  tensors.reserve(manifest.tensors.size());
  for (const TensorSpec& spec : manifest.tensors) {
    const auto begin = global.begin() + int64_t(spec.offset);
    tensors.push_back({spec.name, spec.shape, std::vector<float>(begin, begin + int64_t(spec.numel()))});
  }
  return tensors;
}

// What the user's trainer reported beside its tensors: the steps it took,
// which FedNova weighs its update by (with the task's momentum, as a
// built-in site's are).
client::Update Reported(client::Update update, uint64_t local_steps, const v1::TaskConfig& task) {
  update.trained_on = "the client API's trainer";
  if (local_steps > 0) {
    update.local_steps = local_steps;
    update.normalizer = client::FedNovaNormalizer(
        {.momentum = task.momentum(),
         .optimizer = task.optimizer() == "adamw" ? client::OptimizerKind::kAdamW : client::OptimizerKind::kSgd},
        local_steps);
  }
  return update;
}

// The public Trainer behind client::Trainer: named tensors in, an update out.
class PublicTrainer : public client::Trainer {
 public:
  explicit PublicTrainer(estuary::Trainer& user) : user_(user) {}

  uint64_t num_examples() const override { return user_.num_examples(); }

  Result<client::Update> Train(std::span<const float> global, const Manifest& manifest, const v1::TaskConfig& task,
                               uint64_t round, std::string_view client_name) override {
    if (task.update_kind() != v1::UPDATE_FULL) {
      return InvalidArgument("round {}: a {} federation: the client API trains full updates", round,
                             task.update_kind() == v1::UPDATE_LORA ? "lora" : "other");
    }
    const auto start = std::chrono::steady_clock::now();
    std::vector<estuary::Tensor> tensors = Tensors(global, manifest);
    TrainResult result;
    try {
      result = user_.Train(tensors, TaskInfoOf(task, round, client_name));
    } catch (const std::exception& e) {
      return Aborted("round {}: the trainer threw: {}", round, e.what());
    }
    tensors.clear();
    if (result.num_examples == 0) return InvalidArgument("round {}: the trainer returned num_examples = 0", round);
    double loss = 0;
    for (const auto& [name, value] : result.metrics) {
      if (name == "loss") {
        loss = value;
      } else {
        spdlog::info("{}: round {}: {} = {}", client_name, round, name, value);
      }
    }
    ESTUARY_ASSIGN_OR_RETURN(std::vector<float> flat, Flatten(result.tensors, manifest, round));
    if (result.is_delta) {
      // delta + global is the local model FullUpdate subtracts global from again; to avoid that rounding, take it as given.
      ESTUARY_ASSIGN_OR_RETURN(client::Update update,
                               client::TrainedUpdate(client::UpdateKind::kFull, result.num_examples, loss, round));
      update.manifest = manifest;
      update.payload = std::move(flat);
      update.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      return Reported(std::move(update), result.local_steps, task);
    }
    ESTUARY_ASSIGN_OR_RETURN(client::Update update, client::FullUpdate(std::move(flat), global, manifest,
                                                                       result.num_examples, loss, start, round));
    return Reported(std::move(update), result.local_steps, task);
  }

  Result<client::Evaluation> Evaluate(std::span<const float> global, const Manifest& manifest,
                                      const v1::TaskConfig& task, uint64_t round,
                                      std::string_view client_name) override {
    if (task.update_kind() != v1::UPDATE_FULL) return client::Evaluation{};  // it trains full models only
    const auto start = std::chrono::steady_clock::now();
    EvalResult result;
    try {
      result = user_.Evaluate(Tensors(global, manifest), TaskInfoOf(task, round, client_name));
    } catch (const std::exception& e) {
      return Aborted("round {}: the trainer's evaluation threw: {}", round, e.what());
    }
    if (!result.supported) return client::Evaluation{};
    if (result.num_examples == 0) {
      return InvalidArgument("round {}: the trainer's evaluation returned num_examples = 0", round);
    }
    if (result.has_accuracy && !(result.accuracy >= 0 && result.accuracy <= 1)) {
      return InvalidArgument("round {}: the trainer's evaluation returned accuracy {}, not in [0, 1]", round,
                             result.accuracy);
    }
    return client::Evaluation{
        .supported = true,
        .examples = result.num_examples,
        .loss = result.loss,
        .accuracy = result.has_accuracy ? std::optional<double>(result.accuracy) : std::nullopt,
        .seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
  }

 private:
  estuary::Trainer& user_;
};

}  // namespace

SiteResult RunSite(const SiteOptions& options, estuary::Trainer& trainer) {
  namespace asio = boost::asio;
  SiteResult result;
  client::AgentOptions agent;
  if (Status parsed = ParseHostPort(options.server, &agent.host, &agent.port); !parsed.ok()) {
    result.error = fmt::format("server = '{}': {}", options.server, parsed.message());
    return result;
  }
  const crypto::TlsFiles files{.cert = options.cert, .key = options.key, .ca = options.ca, .crl = options.crl};
  auto context = crypto::MakeClientContext(files);
  if (!context.ok()) {
    result.error = context.status().message();
    return result;
  }
  agent.tls = *context;
  agent.label = std::filesystem::path(options.cert).stem().string();
  agent.max_backoff_s = options.max_backoff_s;
  agent.expected_model = options.expected_model;

  PublicTrainer adapter(trainer);
  asio::io_context io;
  asio::thread_pool training(1);
  auto running = std::make_shared<client::Agent>(io, agent, adapter, training.get_executor());
  Status outcome = Aborted("the site stopped before the federation completed");
  running->on_finished = [&](const Status& status) { outcome = status; };
  running->Start();
  io.run();
  training.join();
  result.ok = outcome.ok();
  if (!outcome.ok()) result.error = outcome.message();
  result.rounds_trained = running->rounds_trained();
  return result;
}

std::string ModelName(const std::vector<TensorLayout>& tensors) {
  std::vector<models::CustomTensor> layout;
  layout.reserve(tensors.size());
  for (const TensorLayout& t : tensors) layout.push_back({t.name, t.shape, t.dtype});
  return models::CustomModelName(layout);
}

}  // namespace estuary
