#include "simulations/workload.h"

#include <google/protobuf/util/json_util.h>
#include <spdlog/spdlog.h>
#include <algorithm>
#include <atomic>
#include <optional>
#include "base/asio.h"
#include <chrono>
#include <cstring>
#include <map>
#include <set>
#include <thread>
#include "aggregation/dp_fedavg.h"
#include "aggregation/lora_strategy.h"
#include "aggregation/sampling.h"
#include "base/host_port.h"
#include "base/seed.h"
#include "base/split.h"
#include "client/agent.h"
#include "client/compute.h"
#include "client/held_out.h"
#include "client/site.h"
#include "client/task.h"
#include "client/trainer.h"
#include "crypto/certs.h"
#include "crypto/revocation.h"
#include "crypto/sha256.h"
#include "crypto/tls.h"
#include "models/dataset.h"
#include "models/federated_model.h"
#include "models/language_model.h"
#include "models/lora_federation.h"
#include "privacy/accountant.h"
#include "server/store.h"
#include "models/model.h"
#include "models/text_corpus.h"
#include "simulations/attack.h"
#include "simulations/instruction_sites.h"
#include "simulations/partition.h"
#include "simulations/population.h"
#include "simulations/stragglers.h"
#include "simulations/server_process.h"

namespace estuary::simulations {

namespace fs = std::filesystem;

static std::vector<std::string> ClientNames(uint32_t n) {
  std::vector<std::string> names;
  for (uint32_t i = 0; i < n; ++i) names.push_back(fmt::format("client-{:03}", i));
  return names;
}

Result<client::LocalSiteOptions> SiteOptionsOf(const Scenario& s) {
  client::LocalSiteOptions options;
  ESTUARY_ASSIGN_OR_RETURN(options.compute, client::ParseCompute(s.device, s.precision));
  options.lora_base = s.lora_base_dtype == "bf16" ? DType::kBF16 : DType::kF32;
  options.recompute = s.recompute;
  options.cache = client::ThreadModelCache;
  return options;
}

// A malicious site: it trains on the data it holds and uploads what the
// attack makes of the delta, in either mode (over TLS too).
class AttackingTrainer final : public client::Trainer {
 public:
  AttackingTrainer(std::unique_ptr<client::Trainer> honest, Attack attack, uint64_t seed, uint32_t site)
      : honest_(std::move(honest)), attack_(attack), seed_(seed), site_(site) {}
  uint64_t num_examples() const override { return honest_->num_examples(); }
  Result<client::Update> Train(std::span<const float> global, const Manifest& manifest, const v1::TaskConfig& task,
                               uint64_t round, std::string_view client_name) override {
    ESTUARY_ASSIGN_OR_RETURN(client::Update update, honest_->Train(global, manifest, task, round, client_name));
    ApplyAttack(attack_, update.payload, seed_, round, site_);
    return update;
  }

 private:
  std::unique_ptr<client::Trainer> honest_;
  Attack attack_;
  uint64_t seed_;
  uint32_t site_;
};

std::unique_ptr<client::Trainer> MakeAttacker(std::unique_ptr<client::Trainer> honest, const Attack& attack,
                                              uint64_t seed, uint32_t site) {
  return std::make_unique<AttackingTrainer>(std::move(honest), attack, seed, site);
}

// Under --evaluate-every: site i's held-out examples, taken out of `data`
// (seeded by the federation's seed and the site); otherwise none.
static Result<client::HeldOutData> HeldOutOf(const Scenario& s, client::SiteData* data, size_t i) {
  if (s.evaluate_every == 0) return client::HeldOutData{};
  return client::SplitHeldOut(data, s.eval_split, MixSeed(MixSeed(s.task().seed(), std::string_view("held-out")), i));
}

// The clients' local datasets, split from the training set by the scenario.
static Result<std::vector<std::unique_ptr<client::Trainer>>> MakeTrainers(
    const Scenario& s, const std::shared_ptr<const models::Dataset>& train) {
  ESTUARY_ASSIGN_OR_RETURN(auto spec, ParsePartition(s.partition));
  if (s.clients > train->size()) {
    return InvalidArgument("sim: --clients {} but {} has {} training examples to split among them; give "
                           "--examples-per-client K to have each site draw K of them (sites then share examples)",
                           s.clients, s.data_dir.string(), train->size());
  }
  ESTUARY_ASSIGN_OR_RETURN(auto parts, Partition(train->labels, train->num_classes, int(s.clients), spec,
                                                 MixSeed(s.task().seed(), std::string_view("partition"))));
  // --attack label-flip: the malicious sites hold the same examples under
  // labels l -> C - 1 - l (a second copy of the training set, only then).
  ESTUARY_ASSIGN_OR_RETURN(const Attack attack, ParseAttack(s.attack));
  std::vector<bool> malicious(s.clients, false);
  if (attack.kind != Attack::Kind::kNone) malicious = ChooseAttackers(s.clients, s.attackers, s.task().seed());
  std::shared_ptr<const models::Dataset> flipped;
  if (attack.kind == Attack::Kind::kLabelFlip) {
    auto copy = std::make_shared<models::Dataset>(*train);
    for (int32_t& label : copy->labels) label = copy->num_classes - 1 - label;
    flipped = std::move(copy);
  }
  ESTUARY_ASSIGN_OR_RETURN(const Stragglers stragglers, ParseStragglers(s.stragglers, s.straggler_work));
  const std::vector<bool> slow = ChooseSites(s.clients, stragglers.fraction, s.task().seed(), "stragglers");
  std::vector<std::unique_ptr<client::Trainer>> trainers;
  ESTUARY_ASSIGN_OR_RETURN(const client::LocalSiteOptions options, SiteOptionsOf(s));
  for (size_t i = 0; i < parts.size(); ++i) {
    client::SiteData data{.images = flipped && malicious[i] ? flipped : train, .indices = std::move(parts[i])};
    ESTUARY_ASSIGN_OR_RETURN(client::HeldOutData held, HeldOutOf(s, &data, i));
    ESTUARY_ASSIGN_OR_RETURN(auto site, client::MakeLocalSite(std::move(data), options));
    std::unique_ptr<client::Trainer> trainer = std::move(site);
    if (malicious[i] && attack.kind != Attack::Kind::kLabelFlip) {
      trainer = MakeAttacker(std::move(trainer), attack, s.task().seed(), uint32_t(i));
    }
    if (slow[i]) trainer = MakeStraggler(std::move(trainer), stragglers, s.task().seed(), uint32_t(i));
    if (s.evaluate_every > 0) trainer = std::make_unique<client::EvaluatingTrainer>(std::move(trainer), std::move(held));
    trainers.push_back(std::move(trainer));
  }
  return trainers;
}

// --lora-site-ranks as numbers; empty when not given.
Result<std::vector<int>> SiteRanks(const Scenario& s) {
  std::vector<int> ranks;
  if (s.lora_site_ranks.empty()) return ranks;
  for (const std::string& part : SplitCommas(s.lora_site_ranks)) {
    char* end = nullptr;
    const long rank = std::strtol(part.c_str(), &end, 10);
    if (part.empty() || *end != '\0' || rank <= 0 || rank > 4096) {
      return InvalidArgument("sim: --lora-site-ranks '{}': '{}' is not a rank in [1, 4096]", s.lora_site_ranks, part);
    }
    ranks.push_back(int(rank));
  }
  return ranks;
}

bool InstructionData(const Scenario& s) { return s.data_dir.extension() == ".jsonl"; }


static Result<Workload> ImageWorkload(const Scenario& s) {
  if (s.examples_per_client > 0) {
    ESTUARY_ASSIGN_OR_RETURN(const auto population, Population::Create(s));
    return population->Materialise();
  }
  ESTUARY_ASSIGN_OR_RETURN(auto train, models::LoadIdx(s.data_dir, models::Split::kTrain));
  Workload w;
  w.names = ClientNames(s.clients);
  ESTUARY_ASSIGN_OR_RETURN(w.trainers, MakeTrainers(s, std::make_shared<const models::Dataset>(std::move(train))));
  return w;
}

// One client per topic of the corpus, named after it.
static Result<Workload> TextWorkload(const Scenario& s) {
  if (s.stragglers > 0) return InvalidArgument("sim: --stragglers: image federations only (MNIST), for now");
  if (s.partition != "topic") {
    return InvalidArgument("sim: --partition {}: language models split their text by topic (--partition topic)",
                           s.partition);
  }
  const v1::TaskConfig& task = s.task();
  ESTUARY_ASSIGN_OR_RETURN(const models::LlamaConfig config, models::LlamaPreset(task.model()));
  if (config.vocab_size != models::ByteTokenizer::kVocabSize) {
    return InvalidArgument("sim: {} has a {}-token vocabulary; the fortunes corpus is byte-level (256)", task.model(),
                           config.vocab_size);
  }
  if (task.seq_len() > uint32_t(config.max_seq_len)) {
    return InvalidArgument("sim: --seq-len {} exceeds {}'s context of {}", task.seq_len(), task.model(),
                           config.max_seq_len);
  }
  ESTUARY_ASSIGN_OR_RETURN(auto sources, models::LoadFortunes(s.data_dir, {.test_fraction = 0.1,
                                                                           .seed = task.seed(),
                                                                           .min_tokens = task.seq_len() + 1}));
  if (!s.topics.empty()) {
    // The named topics, in the order given: client i holds topics[i].
    std::vector<models::TextSource> chosen;
    for (const std::string& topic : SplitCommas(s.topics)) {
      auto it = std::find_if(sources.begin(), sources.end(), [&](const auto& source) { return source.name == topic; });
      if (it == sources.end()) {
        return InvalidArgument("sim: --topics: {} has no topic '{}' with enough text", s.data_dir.string(), topic);
      }
      chosen.push_back(std::move(*it));
      sources.erase(it);
    }
    sources = std::move(chosen);
    if (s.clients != sources.size()) {
      return InvalidArgument("sim: --clients {} but --topics names {}", s.clients, sources.size());
    }
  }
  if (s.clients > sources.size()) {
    return InvalidArgument("sim: --clients {} but {} has {} topics with enough text; use --clients {} or fewer",
                           s.clients, s.data_dir.string(), sources.size(), sources.size());
  }
  ESTUARY_ASSIGN_OR_RETURN(client::LocalSiteOptions options, SiteOptionsOf(s));
  ESTUARY_ASSIGN_OR_RETURN(const std::vector<int> site_ranks, SiteRanks(s));
  Workload w;
  for (uint32_t i = 0; i < s.clients; ++i) {
    w.names.push_back(sources[i].name);
    options.lora_rank = site_ranks.empty() ? 0 : site_ranks[i % site_ranks.size()];
    client::SiteData data{.text = std::make_shared<const std::vector<int32_t>>(std::move(sources[i].train))};
    ESTUARY_ASSIGN_OR_RETURN(client::HeldOutData held, HeldOutOf(s, &data, i));
    ESTUARY_ASSIGN_OR_RETURN(auto site, client::MakeLocalSite(std::move(data), options));
    std::unique_ptr<client::Trainer> trainer = std::move(site);
    if (s.evaluate_every > 0) trainer = std::make_unique<client::EvaluatingTrainer>(std::move(trainer), std::move(held));
    w.trainers.push_back(std::move(trainer));
  }
  return w;
}

// Sites drawn from one JSON Lines file, by a field or by Dirichlet over a label.
static Result<Workload> InstructionWorkload(const Scenario& s) {
  if (s.stragglers > 0) return InvalidArgument("sim: --stragglers: image federations only (MNIST), for now");
  const v1::TaskConfig& task = s.task();
  ESTUARY_ASSIGN_OR_RETURN(InstructionSplit split,
                           SplitInstructionFile({.data = s.data_dir, .tokenizer = s.tokenizer,
                                                 .prompt_template = task.prompt_template(), .sites = s.clients,
                                                 .partition_by = s.partition_by,
                                                 .dirichlet_alpha = s.dirichlet_alpha, .label_field = s.label_field,
                                                 .seq_len = int(task.seq_len()), .seed = task.seed()}));
  ESTUARY_ASSIGN_OR_RETURN(client::LocalSiteOptions options, SiteOptionsOf(s));
  ESTUARY_ASSIGN_OR_RETURN(const std::vector<int> site_ranks, SiteRanks(s));
  Workload w;
  w.names = std::move(split.names);
  w.held_out = std::move(split.held_out);
  w.held_out_jsonl = std::move(split.held_out_jsonl);
  for (size_t i = 0; i < split.sites.size(); ++i) {
    options.lora_rank = site_ranks.empty() ? 0 : site_ranks[i % site_ranks.size()];
    ESTUARY_ASSIGN_OR_RETURN(
        auto site,
        client::MakeLocalSite({.instructions = std::make_shared<const models::InstructionSet>(std::move(split.sites[i]))},
                              options));
    w.trainers.push_back(std::move(site));
  }
  return w;
}

// The clients: their names and trainers, from the scenario's data.
Result<Workload> ClientsOf(const Scenario& s) {
  if (!models::IsLanguageModel(s.task().model())) return ImageWorkload(s);
  return InstructionData(s) ? InstructionWorkload(s) : TextWorkload(s);
}

}  // namespace estuary::simulations
