#include "aggregation/federation_flags.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "aggregation/strategy.h"
#include "base/split.h"

namespace estuary::aggregation {

namespace {

// The flags being added, each over one field: `set` stores the parsed value
// into the message, `current` is what --help shows as the default.
class FlagSet {
 public:
  explicit FlagSet(CLI::App& app) : app_(app) {}

  template <typename T, typename Set>
  CLI::Option* Add(const std::string& name, const T& current, Set set, const std::string& help) {
    return Keep(app_.add_option_function<T>(name, std::move(set), help)->default_str(fmt::format("{}", current)));
  }
  template <typename Set>
  CLI::Option* AddBool(const std::string& name, bool current, Set set, const std::string& help) {
    // --flag, --flag=true or --flag=false (a config file's `flag = false`).
    auto* option = app_.add_flag_function(name, [set](int64_t count) { set(count > 0); }, help);
    return Keep(option->default_str(current ? "true" : "false"));
  }
  std::vector<CLI::Option*> added() const { return added_; }

 private:
  CLI::Option* Keep(CLI::Option* option) {
    added_.push_back(option);
    return option;
  }
  CLI::App& app_;
  std::vector<CLI::Option*> added_;
};

}  // namespace

std::vector<CLI::Option*> AddFederationFlags(CLI::App& app, v1::FederationConfig* config) {
  v1::TaskConfig* task = config->mutable_task();
  v1::LoraTask* lora = task->mutable_lora();
  v1::StrategyConfig* strategy = config->mutable_strategy();
  FlagSet flags(app);

  flags.Add("--model", task->model(), [task](const std::string& v) { task->set_model(v); },
            "mlp | cnn | llama-tiny | llama-small | llama-124m");
  flags.Add("--epochs", task->epochs(), [task](uint32_t v) { task->set_epochs(v); }, "local epochs per round");
  flags.Add("--batch", task->batch_size(), [task](uint32_t v) { task->set_batch_size(v); }, "local batch size");
  flags.Add("--lr", task->learning_rate(), [task](float v) { task->set_learning_rate(v); }, "local learning rate");
  flags.Add("--momentum", task->momentum(), [task](float v) { task->set_momentum(v); }, "local SGD momentum");
  flags.Add("--weight-decay", task->weight_decay(), [task](float v) { task->set_weight_decay(v); },
            "local weight decay");
  flags.Add("--optimizer", task->optimizer(), [task](const std::string& v) { task->set_optimizer(v); },
            "local optimizer, fresh every round: sgd | adamw");
  flags.Add("--seq-len", task->seq_len(), [task](uint32_t v) { task->set_seq_len(v); },
            "language models: tokens per training window");
  flags.Add("--proximal-mu", task->proximal_mu(), [task](float v) { task->set_proximal_mu(v); },
            "FedProx: mu of the proximal term mu/2 |w - w_global|^2 in each site's local objective (0: off)");
  flags.Add("--template", task->prompt_template(),
            [task](const std::string& v) { task->set_prompt_template(v); },
            "language models on instruction JSONL: the prompt template every site renders its examples with "
            "(llama3 | chatml | alpaca | none)");
  flags.Add("--max-local-steps", task->max_local_steps(), [task](uint32_t v) { task->set_max_local_steps(v); },
            "cap on local optimizer steps per round (0: every batch of every epoch)");
  flags.Add("--max-local-seconds", task->max_local_seconds(), [task](double v) { task->set_max_local_seconds(v); },
            "cap on each site's local training time per round, in seconds: a site stops after the step that "
            "crosses it and reports the steps it took (0: no cap)");
  flags.Add("--seed", task->seed(), [task](uint64_t v) { task->set_seed(v); },
            "one seed for initialisation, sampling and shuffling");
  flags
      .Add("--update-kind", std::string(task->update_kind() == v1::UPDATE_LORA ? "lora" : "full"),
           [task](const std::string& v) { task->set_update_kind(v == "lora" ? v1::UPDATE_LORA : v1::UPDATE_FULL); },
           "what sites upload: full (weight deltas) | lora (adapter factors; language models)")
      ->check(CLI::IsMember({"full", "lora"}));

  flags.Add("--lora-rank", lora->rank(), [lora](uint32_t v) { lora->set_rank(v); }, "lora: adapter rank r");
  flags.Add("--lora-alpha", lora->alpha(), [lora](float v) { lora->set_alpha(v); },
            "lora: lora_alpha (the update is alpha/r * B A)");
  flags.Add("--lora-dropout", lora->dropout(), [lora](float v) { lora->set_dropout(v); },
            "lora: dropout on the adapters' input, in [0, 1)");
  flags.Add("--lora-targets", fmt::format("{}", fmt::join(lora->target_modules(), ",")),
            [lora](const std::string& v) {
              lora->clear_target_modules();
              for (const std::string& module : SplitCommas(v)) lora->add_target_modules(module);
            },
            "lora: comma-separated q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj");
  flags.Add("--lora-merge", lora->merge(), [lora](const std::string& v) { lora->set_merge(v); },
            "lora: how the server merges adapters: naive | exact | frozen-a");
  flags.AddBool("--lora-mixed-ranks", lora->mixed_ranks(), [lora](bool v) { lora->set_mixed_ranks(v); },
                "lora, exact only: accept adapters of other ranks than --lora-rank");

  flags.Add("--strategy", strategy->name(), [strategy](const std::string& v) { strategy->set_name(v); },
            fmt::format("how full updates merge: {}", fmt::join(kStrategyNames, " | ")));
  flags
      .Add("--server-lr", strategy->server_lr(), [strategy](double v) { strategy->set_server_lr(v); },
           "fedavgm, fedadam, fedyogi, fedadagrad, scaffold: server learning rate (> 0)")
      ->default_str(strategy->server_lr() != 0 ? fmt::format("{}", strategy->server_lr())
                                               : "1 under fedavgm and scaffold, 0.01 under the others")
      // 0 in a federation file means the default; given on the command line it is a mistake.
      ->check(CLI::Validator(
          [](std::string& text) {
            char* end = nullptr;
            const double v = std::strtod(text.c_str(), &end);
            return *end == '\0' && v > 0 ? std::string() : fmt::format("--server-lr {}: must be > 0", text);
          },
          ""));
  flags.Add("--server-momentum", strategy->server_momentum(),
            [strategy](double v) { strategy->set_server_momentum(v); }, "fedavgm: server momentum, in [0, 1)");
  flags.Add("--beta1", strategy->beta1(), [strategy](double v) { strategy->set_beta1(v); },
            "fedadam, fedyogi, fedadagrad: first-moment decay, in [0, 1)");
  flags.Add("--beta2", strategy->beta2(), [strategy](double v) { strategy->set_beta2(v); },
            "fedadam, fedyogi: second-moment decay, in [0, 1)");
  flags.Add("--tau", strategy->tau(), [strategy](double v) { strategy->set_tau(v); },
            "fedadam, fedyogi, fedadagrad: adaptivity tau (> 0)");
  flags.Add("--trim", strategy->trim(), [strategy](double v) { strategy->set_trim(v); },
            "trimmed-mean: fraction beta of updates dropped from each end per coordinate, in [0, 0.5)");
  flags.Add("--byzantine", strategy->byzantine(), [strategy](uint32_t v) { strategy->set_byzantine(v); },
            "krum, multi-krum, bulyan: Byzantine updates f tolerated (krum needs n >= 2f+3, bulyan n >= 4f+3)");
  flags.Add("--krum-select", strategy->krum_select(), [strategy](uint32_t v) { strategy->set_krum_select(v); },
            "multi-krum: updates m averaged, in [1, n - f] (0: n - f)");
  flags.Add("--total-sites", strategy->total_sites(), [strategy](uint32_t v) { strategy->set_total_sites(v); },
            "N, the federation's sites: scaffold's control variate's update divides by it (estuary-sim: --clients "
            "when 0); serve --sample-rate with DP-FedAvg divides its mean by Q x N");
  flags.Add("--base-model", config->base_model(), [config](const std::string& v) { config->set_base_model(v); },
            "lora: the preset's base weights (a safetensors file), or a Hugging Face model directory that every "
            "site holds too and the server never sends (default: the preset initialised from --seed)");
  flags.Add("--initial-model", config->initial_model(),
            [config](const std::string& v) { config->set_initial_model(v); },
            "a safetensors file: federate its tensors by name, shape and dtype, with no architecture known to the "
            "server (the task's model becomes custom@<12 hex of their layout>; update kind full)");
  flags.Add("--eval-windows", config->eval_windows(), [config](uint64_t v) { config->set_eval_windows(v); },
            "language models: held-out windows scored per round");

  v1::UpdateLimits* limits = config->mutable_limits();
  flags.Add("--max-update-norm", limits->max_norm(), [limits](double v) { limits->set_max_norm(v); },
            "full updates: scale an update whose L2 norm exceeds this down to it (0: none)");
  flags.Add("--max-norm-over-median", limits->max_norm_over_median(),
            [limits](double v) { limits->set_max_norm_over_median(v); },
            "full updates: the same, at this many times the median norm of the last round's updates (0: none)");
  flags.Add("--max-examples", limits->max_examples(), [limits](uint64_t v) { limits->set_max_examples(v); },
            "refuse an update claiming more examples than this as its weight (0: none)");

  v1::DpConfig* dp = config->mutable_dp();
  flags.Add("--dp-noise-multiplier", dp->noise_multiplier(), [dp](double v) { dp->set_noise_multiplier(v); },
            "DP-FedAvg: Gaussian noise of stddev this times the clip norm on the sum of updates (0: DP off)");
  flags.Add("--dp-clip", dp->clip(), [dp](double v) { dp->set_clip(v); },
            "DP-FedAvg: L2 norm each site's update is clipped to (adaptive: the starting norm)");
  flags.AddBool("--dp-adaptive-clip", dp->adaptive_clip(), [dp](bool v) { dp->set_adaptive_clip(v); },
                "DP-FedAvg: move the clip norm toward --dp-target-quantile of the update norms (Andrew et al.)");
  flags.Add("--dp-target-quantile", dp->target_quantile(), [dp](double v) { dp->set_target_quantile(v); },
            "DP-FedAvg, adaptive: fraction of updates that should fall under the clip norm");
  flags.Add("--dp-clip-lr", dp->clip_lr(), [dp](double v) { dp->set_clip_lr(v); },
            "DP-FedAvg, adaptive: geometric learning rate of the clip norm");
  flags.Add("--dp-clipped-count-stddev", dp->clipped_count_stddev(),
            [dp](double v) { dp->set_clipped_count_stddev(v); },
            "DP-FedAvg, adaptive: noise stddev on the count of unclipped updates (0: 0.05 x sampled sites)");
  flags.Add("--dp-delta", dp->delta(), [dp](double v) { dp->set_delta(v); },
            "DP-FedAvg: the delta that epsilon is reported at");
  flags.Add("--dp-max-epsilon", dp->max_epsilon(), [dp](double v) { dp->set_max_epsilon(v); },
            "DP-FedAvg: stop before a round that would take epsilon beyond this (0: no limit)");
  return flags.added();
}

}  // namespace estuary::aggregation
