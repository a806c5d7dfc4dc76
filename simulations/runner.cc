#include "simulations/runner.h"

#include <google/protobuf/util/json_util.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <set>

#include "aggregation/dp_fedavg.h"
#include "aggregation/lora_strategy.h"
#include "aggregation/robust_strategy.h"
#include "aggregation/sampling.h"
#include "aggregation/scaffold.h"
#include "base/asio.h"
#include "base/atomic_file.h"
#include "base/host_port.h"
#include "base/memory.h"
#include "base/parallel_for.h"
#include "base/seed.h"
#include "base/split.h"
#include "client/agent.h"
#include "client/compute.h"
#include "client/scaffold.h"
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
#include "models/model.h"
#include "models/text_corpus.h"
#include "privacy/accountant.h"
#include "server/evaluation.h"
#include "server/store.h"
#include "simulations/attack.h"
#include "simulations/dropout_draw.h"
#include "simulations/federated_eval.h"
#include "simulations/instruction_sites.h"
#include "simulations/partition.h"
#include "simulations/poisson_sampling.h"
#include "simulations/population.h"
#include "simulations/scenario_checks.h"
#include "simulations/server_process.h"
#include "simulations/sim_ranks.h"
#include "simulations/stragglers.h"
#include "simulations/workload.h"

namespace estuary::simulations {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

static double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

v1::FederationConfig FederationOf(const Scenario& s) {
  v1::FederationConfig federation = s.federation;
  if (!s.lora_site_ranks.empty()) federation.mutable_task()->mutable_lora()->set_mixed_ranks(true);
  v1::StrategyConfig& strategy = *federation.mutable_strategy();
  if (strategy.name() == "scaffold" && strategy.total_sites() == 0) strategy.set_total_sites(s.clients);
  return federation;
}

nlohmann::json ScenarioJson(const Scenario& s) {
  std::string federation;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(FederationOf(s), &federation, options);
  nlohmann::json out = {{"federation", nlohmann::json::parse(federation)},
          {"clients", s.clients}, {"per_round", s.per_round}, {"sample_rate", s.sample_rate}, {"rounds", s.rounds}, {"partition", s.partition},
          {"examples_per_client", s.examples_per_client},
          {"topics", s.topics}, {"mode", s.mode}, {"threads", s.threads}, {"data", s.data_dir.string()},
          {"device", s.device}, {"precision", s.precision}, {"lora_site_ranks", s.lora_site_ranks},
          {"lora_base_dtype", s.lora_base_dtype}, {"tokenizer", s.tokenizer.string()},
          {"partition_by", s.partition_by}, {"dirichlet", s.dirichlet_alpha}, {"label_field", s.label_field},
          {"attack", s.attack}, {"attackers", s.attackers}, {"recompute", s.recompute},
          {"stragglers", s.stragglers}, {"straggler_work", s.straggler_work}, {"dp", s.dp},
          {"dropout", s.dropout}};
  if (s.async) {
    out["async"] = {{"buffer", s.buffer}, {"concurrency", s.concurrency}, {"staleness_weight", s.staleness_weight},
                    {"max_staleness", s.max_staleness}};
  }
  if (s.evaluate_every > 0) {
    out["evaluate"] = {{"every", s.evaluate_every}, {"clients", s.evaluate_clients}, {"eval_split", s.eval_split}};
  }
  if (s.secagg) {
    const SecAggOptions& o = s.secagg_options;
    out["secagg"] = {{"neighbours", o.neighbours}, {"threshold", o.threshold}, {"bits", o.bits}, {"clip", o.clip},
                     {"dropout", s.dropout}, {"dp_survivors", o.dp.survivors}};
  }
  return out;
}

// The clients — built up front, or with --examples-per-client a population
// made as it is sampled — plus the federation as the server builds it.
struct Simulation {
  Workload clients;
  std::shared_ptr<const Population> population;
  aggregation::Federation federation;
};

namespace {

// The sites by index, in the order of their names: a workload's or a population's.
class SiteSet {
 public:
  SiteSet(const Scenario& s, Simulation& sim) : s_(s), clients_(sim.clients), population_(sim.population) {
    for (size_t i = 0; i < clients_.names.size(); ++i) index_of_[clients_.names[i]] = i;
    if (!population_) {
      malicious_ = ChooseAttackers(uint32_t(clients_.names.size()), s.attackers, s.task().seed());
      slow_ = ChooseSites(uint32_t(clients_.names.size()), s.stragglers, s.task().seed(), "stragglers");
    }
  }
  uint64_t size() const { return population_ ? population_->size() : clients_.names.size(); }
  std::string Name(uint64_t site) const { return population_ ? population_->Name(site) : clients_.names[site]; }
  bool Malicious(uint64_t site) const { return population_ ? population_->Malicious(site) : bool(malicious_[site]); }
  bool Straggles(uint64_t site) const {
    if (s_.stragglers <= 0) return false;
    return population_ ? IsChosenSite(site, size(), s_.stragglers, s_.task().seed(), "stragglers") : bool(slow_[site]);
  }
  uint64_t attackers() const {
    return population_ ? population_->attackers() : std::count(malicious_.begin(), malicious_.end(), true);
  }
  // Poisson sampling (--sample-rate q): each site joins with probability q;
  // otherwise a fixed number. Ascending by name.
  std::vector<uint64_t> Sample(uint64_t round) const {
    if (population_) return population_->Sample(round);
    const uint64_t seed = s_.task().seed();
    const std::vector<std::string> names =
        s_.sample_rate > 0 ? PoissonSample(clients_.names, s_.sample_rate, seed, round)
                           : aggregation::SampleClients(clients_.names,
                                                        aggregation::ClientsPerRound(s_.per_round, size()), seed, round);
    std::vector<uint64_t> sites;
    for (const std::string& name : names) sites.push_back(index_of_.at(name));
    return sites;
  }
  // `train` on the site's trainer: a population's is made for the call and dropped after it.
  Result<client::Update> Train(uint64_t site,
                               const std::function<Result<client::Update>(client::Trainer&)>& train) const {
    if (!population_) return train(*clients_.trainers[site]);
    ESTUARY_ASSIGN_OR_RETURN(const std::unique_ptr<client::Trainer> trainer, population_->Site(site));
    return train(*trainer);
  }

 private:
  const Scenario& s_;
  Workload& clients_;
  std::shared_ptr<const Population> population_;
  std::map<std::string, uint64_t> index_of_;
  std::vector<bool> malicious_, slow_;
};

}  // namespace

static Result<Simulation> MakeSimulation(const Scenario& given) {
  Simulation sim;
  // On a Hugging Face base the clients build the model the task names after it.
  Scenario s = given;
  ESTUARY_RETURN_IF_ERROR(aggregation::ApplyHfBase(&s.federation).status());
  if (s.examples_per_client > 0 && !models::IsLanguageModel(s.task().model())) {
    ESTUARY_ASSIGN_OR_RETURN(sim.population, Population::Create(s));
  } else {
    ESTUARY_ASSIGN_OR_RETURN(sim.clients, ClientsOf(s));
  }
  // Distributed DP noises on the sites (secagg_round.h): the server's strategy adds none.
  if (s.dp == "distributed") s.federation.clear_dp();
  // Seeded DP noise: a simulation reproduces from its seed (dp_noise.h).
  ESTUARY_ASSIGN_OR_RETURN(sim.federation,
                           aggregation::MakeFederation(FederationOf(s),
                                                       {.data = InstructionData(s) ? fs::path() : s.data_dir,
                                                        .threads = int(s.threads), .rows = sim.clients.held_out},
                                                       aggregation::DpNoise::kSeeded));
  return sim;
}

// Calls train(i) for the sampled sites i this rank trains — all k in one
// process, i mod N == rank under mpirun (sim_ranks.h) — `threads` at a time.
static void TrainOwned(size_t k, const SimRanks* ranks, uint32_t threads, const std::function<void(size_t)>& train) {
  std::vector<size_t> mine;
  for (size_t i = 0; i < k; ++i) {
    if (!ranks || ranks->OwnerOf(i) == ranks->rank()) mine.push_back(i);
  }
  ParallelFor(mine.size(), threads, [&](size_t j) { train(mine[j]); });
}

Status ServeInprocRank(const Scenario& s, SimRanks& ranks) {
  Result<Simulation> made = [&]() -> Result<Simulation> {
    ESTUARY_RETURN_IF_ERROR(CheckScenario(s));
    return MakeSimulation(s);
  }();
  ESTUARY_RETURN_IF_ERROR(ranks.Settle(made.status()));  // rank 0 reports a failure, whichever rank's
  Simulation& sim = *made;
  const SiteSet sites(s, sim);
  const Manifest& manifest = sim.federation.manifest;
  std::vector<float>& global = sim.federation.initial;
  const v1::TaskConfig& task = sim.federation.config.task();
  // Past Settle rank 0 waits on this rank's updates: a failure here ends the job.
  auto or_abort = [&](const Status& status) {
    if (!status.ok()) ranks.Abort(status);
  };
  for (;;) {
    Result<RoundOrder> order = ranks.ShareOrder({});
    or_abort(order.status());
    if (order->round == 0) return Status::Ok();
    or_abort(ranks.ShareGlobal(global));
    const size_t k = order->sites.size();
    std::vector<std::optional<Result<client::Update>>> updates(k);
    TrainOwned(k, &ranks, s.threads, [&](size_t i) {
      const uint64_t site = order->sites[i];
      updates[i] = sites.Train(site, [&](client::Trainer& trainer) {
        return trainer.Train(global, manifest, task, order->round, sites.Name(site));
      });
    });
    for (size_t i = 0; i < k; ++i) {
      if (ranks.OwnerOf(i) == ranks.rank()) or_abort(ranks.SendUpdate(*updates[i]));
    }
  }
}

Result<Report> RunInproc(const Scenario& s, const RoundCallback& on_round, std::vector<float>* final_global,
                         SimRanks* ranks) {
  // Under mpirun, every way out of the run ends the other ranks' loop (sim_ranks.h).
  struct CloseRanks {
    SimRanks* ranks;
    ~CloseRanks() {
      if (ranks) ranks->Close();
    }
  } close_ranks{ranks};
  ESTUARY_RETURN_IF_ERROR(CheckScenario(s));
  const auto start = Clock::now();
  ESTUARY_ASSIGN_OR_RETURN(Simulation sim, MakeSimulation(s));
  const Manifest& manifest = sim.federation.manifest;
  std::vector<float>& global = sim.federation.initial;
  aggregation::Strategy& strategy = *sim.federation.strategy;
  const SiteSet sites(s, sim);
  const uint64_t population = sites.size();
  const v1::TaskConfig& task = sim.federation.config.task();  // what the server would send every site

  Report report;
  report.scenario = ScenarioJson(s);
  report.mode = "inproc";
  // DP: the server's accountant, with q = sampled / clients.
  const v1::DpConfig dp = s.federation.dp();
  const bool distributed_dp = s.dp == "distributed";
  SecAggOptions secagg = s.secagg_options;
  secagg.dropout = s.dropout;
  if (distributed_dp) {
    secagg.dp.noise_multiplier = dp.noise_multiplier();
    secagg.dp.clip = dp.clip();
  }
  // What the protocol sums: the full delta, or a lora federation's upload.
  const uint64_t secagg_dimension = sim.federation.lora
                                        ? aggregation::ExpectedLoraUpload(*sim.federation.lora).total_elements
                                        : manifest.total_elements;
  std::optional<privacy::Accountant> accountant;
  if (dp.noise_multiplier() > 0) {
    ESTUARY_ASSIGN_OR_RETURN(accountant, privacy::Accountant::Create(dp.delta()));
  }
  ESTUARY_ASSIGN_OR_RETURN(const Attack attack, ParseAttack(s.attack));
  if (attack.kind != Attack::Kind::kNone) report.attackers = sites.attackers();
  // SCAFFOLD: the server's c travels down with the model, each site's Δc up
  // with its delta, and each site keeps its c_i here, by site: only the
  // sites sampled so far have one.
  auto* scaffold = dynamic_cast<aggregation::Scaffold*>(&strategy);
  std::map<uint64_t, client::SiteControl> site_controls;
  // The simulated clock: a round ends when its slowest site does (stragglers.h).
  ESTUARY_ASSIGN_OR_RETURN(const Stragglers stragglers, ParseStragglers(s.stragglers, s.straggler_work));
  double sim_time = 0;
  if (ranks) {
    ESTUARY_RETURN_IF_ERROR(ranks->Settle(Status::Ok()));
    report.mpi_ranks = uint64_t(ranks->size());
  }
  for (uint64_t round = 1; round <= s.rounds; ++round) {
    const auto round_start = Clock::now();
    // Under Poisson sampling the accountant is told q; otherwise q = k / N.
    const bool poisson = s.sample_rate > 0;
    const std::vector<uint64_t> selected_sites = sites.Sample(round);
    std::vector<std::string> selected;
    for (uint64_t site : selected_sites) selected.push_back(sites.Name(site));
    const size_t k = selected.size();
    const double sampling_rate = poisson ? s.sample_rate : double(k) / double(population);
    if (poisson && k < (s.secagg ? 2u : 1u)) {
      return FailedPrecondition("sim: round {}: --sample-rate {} drew {} of {} sites; a round needs {} (choose q · "
                                "sites well above it)",
                                round, s.sample_rate, k, population, s.secagg ? 2 : 1);
    }
    // The fixed denominator: the sites sampled, or under Poisson sampling the expected q · N.
    const double expected = poisson ? s.sample_rate * double(population) : double(k);
    secagg.dp.denominator = expected;
    if (poisson) {
      secagg.dp.expected_sites = expected;
      secagg.dp.max_sites = PoissonPlannedMaximum(uint32_t(population), s.sample_rate);
    }
    if (accountant && dp.max_epsilon() > 0) {
      // Distributed: as if only the fewest inputs the server may unmask were summed.
      ESTUARY_ASSIGN_OR_RETURN(const privacy::Epsilon next,
                               distributed_dp ? DistributedDpPreview(*accountant, secagg, sampling_rate, k,
                                                                     secagg_dimension)
                                              : accountant->EpsilonAfter(sampling_rate, dp.noise_multiplier()));
      if (next.epsilon > dp.max_epsilon()) {
        spdlog::warn("federation stops before round {}: ε would reach {:.4g} at δ {:g}, beyond dp_max_epsilon {:g} "
                     "(ε {:.4g} after {} rounds)",
                     round, next.epsilon, dp.delta(), dp.max_epsilon(), accountant->Spent().epsilon,
                     accountant->rounds());
        break;
      }
    }
    // lora under --secagg: the global adapter's tensors in the upload layout, this round's.
    std::optional<SecAggLoraReference> lora_reference;
    if (s.secagg && sim.federation.lora) {
      ESTUARY_ASSIGN_OR_RETURN(lora_reference, LoraReferenceOf(*sim.federation.lora, global));
    }
    std::vector<std::optional<Result<client::Update>>> updates(k);
    std::vector<float> control;  // SCAFFOLD: the c this round's sites correct by
    if (scaffold) {
      ESTUARY_ASSIGN_OR_RETURN(control, scaffold->Control(global.size()));
      for (uint64_t site : selected_sites) site_controls[site];  // made here: the threads only look them up
    }
    // Under mpirun the other ranks train their share meanwhile, and rank 0
    // takes their updates into their places: the fold below is one process's.
    const uint64_t mpi_bytes_before = ranks ? ranks->bytes() : 0;
    if (ranks) {
      ESTUARY_RETURN_IF_ERROR(ranks->ShareOrder({.round = round, .sites = selected_sites}).status());
      ESTUARY_RETURN_IF_ERROR(ranks->ShareGlobal(global));
    }
    TrainOwned(k, ranks, s.threads, [&](size_t i) {
      const uint64_t site = selected_sites[i];
      updates[i] = sites.Train(site, [&](client::Trainer& trainer) {
        return scaffold ? site_controls.at(site).Train(trainer, global, manifest, task, round, selected[i], control)
                        : trainer.Train(global, manifest, task, round, selected[i]);
      });
    });
    for (size_t i = 0; ranks && i < k; ++i) {  // every one, even after a failed site: the ranks are sending
      const int owner = ranks->OwnerOf(i);
      if (owner != 0) {
        updates[i] = ranks->ReceiveUpdate(owner);
      } else if (updates[i]->ok()) {
        ++ranks->updates_by_rank()[0];
      }
    }
    double round_time = 0;
    for (size_t i = 0; i < k; ++i) {
      const uint64_t site = selected_sites[i];
      const double speed = SiteSpeed(stragglers, sites.Straggles(site), s.task().seed(), round, uint32_t(site));
      if (updates[i]->ok()) round_time = std::max(round_time, double((*updates[i])->local_steps) / speed);
    }
    sim_time += round_time;

    // Fold in the sorted order of the names, whatever order training finished
    // in, each as the federation's limits admit it, as the server does.
    aggregation::UpdateBound& bound = sim.federation.bound;
    bound.BeginRound();
    strategy.PlanRound(k);
    // Under Poisson sampling DP-FedAvg divides by the expected q · N, a
    // constant, so one site's presence changes only the sum (as the server).
    if (auto* dp_strategy = dynamic_cast<aggregation::DpFedAvg*>(&strategy); dp_strategy && poisson) {
      dp_strategy->PlanExpected(expected);
    }
    ESTUARY_RETURN_IF_ERROR(strategy.Begin(round, global));
    RoundReport row;
    row.round = round;
    row.clients_selected = uint32_t(k);
    // --dropout without --secagg: the sites drawn to drop trained (the cost
    // is paid) and their updates never reach the fold, as a server discards
    // an upload that never came or came only in part.
    std::vector<SiteDropStage> dropped(k, SiteDropStage::kNone);
    if (!s.secagg && s.dropout > 0) {
      dropped = DrawSiteDropouts(s.dropout, uint32_t(k), task.seed(), round);
      row.dropouts_by_stage = CountByStage(dropped);
      row.dropouts = (*row.dropouts_by_stage)[0] + (*row.dropouts_by_stage)[1];
    }
    double loss_sum = 0, examples = 0;
    if (report.attackers) row.attackers = row.updates_refused = 0;
    auto received = [&](const client::Update& update) {
      ++row.updates_received;
      row.bytes_up += (update.payload.size() + update.control_delta.size()) * sizeof(float);
      row.bytes_down += manifest.byte_size() * (scaffold ? 2 : 1);
      loss_sum += update.train_loss * double(update.num_examples);
      examples += double(update.num_examples);
      if (report.trained_on.empty()) report.trained_on = update.trained_on;
    };
    std::vector<SecAggSiteInput> secagg_inputs;  // under --secagg: the round's updates, into the protocol
    std::vector<size_t> secagg_update;            // secagg_inputs[j] is updates[secagg_update[j]]
    std::vector<std::vector<float>> moved(k);     // lora under --secagg: upload − the global's same tensors
    for (size_t i = 0; i < k; ++i) {
      if (!updates[i]->ok()) return updates[i]->status();
      client::Update& update = updates[i]->value();
      if (sites.Malicious(selected_sites[i])) ++*row.attackers;  // its trainer attacked (workload.cc)
      if (dropped[i] != SiteDropStage::kNone) continue;
      // Under an attack, as the server does: an update the bound or the
      // strategy refuses is that update's failure, and the round goes on.
      // Without one, a refused update is the simulation's bug and ends the run.
      auto refuse = [&](const Status& why) {
        spdlog::warn("round {}: update from {} refused: {}", round, selected[i], why.message());
        ++*row.updates_refused;
      };
      auto admitted_or = bound.Admit(update.payload, update.num_examples);
      if (!admitted_or.ok() && report.attackers) {
        refuse(admitted_or.status());
        continue;
      }
      ESTUARY_ASSIGN_OR_RETURN(const aggregation::UpdateBound::Admitted admitted, std::move(admitted_or));
      if (!admitted.note().empty()) spdlog::warn("round {}: update from {}: {}", round, selected[i], admitted.note());
      if (s.secagg && lora_reference) {  // the protocol sums how far each site moved the adapter
        ESTUARY_RETURN_IF_ERROR(aggregation::CheckLoraUpload(selected[i], update.manifest, *sim.federation.lora));
        moved[i].resize(update.payload.size());
        for (size_t j = 0; j < moved[i].size(); ++j) moved[i][j] = update.payload[j] - lora_reference->values[j];
        secagg_inputs.push_back({moved[i], double(update.num_examples)});
        secagg_update.push_back(i);
        continue;
      }
      if (s.secagg) {  // no norm bound under secagg (CheckSecAgg): the values are the payload
        secagg_inputs.push_back({update.payload, double(update.num_examples)});
        secagg_update.push_back(i);
        continue;
      }
      const Status folded =
          scaffold ? scaffold->FoldControl(selected[i], admitted.values(), update.control_delta,
                                           double(update.num_examples))
                   : strategy.FoldWork(selected[i], update.manifest, nullptr, admitted.values(), double(update.num_examples),
                            {.steps = update.local_steps, .normalizer = update.normalizer});
      if (!folded.ok() && report.attackers) {
        refuse(folded);
        continue;
      }
      ESTUARY_RETURN_IF_ERROR(folded);
      received(update);
    }
    if (s.secagg) {
      ESTUARY_ASSIGN_OR_RETURN(const SecAggRoundResult sum,
                               RunSecAggRound(secagg, secagg_inputs, task.seed(), round));
      if (sum.clipped) {
        spdlog::warn("round {}: secagg: {} of {} updates clipped to norm {}", round, sum.clipped, secagg_inputs.size(),
                     distributed_dp ? secagg.dp.clip : secagg.clip);
      }
      if (distributed_dp) {  // charged with the shares actually summed
        ESTUARY_ASSIGN_OR_RETURN(const auto rdp, DistributedDpRoundRdp(sum.dp, uint32_t(sum.included.size()),
                                                                       sampling_rate, accountant->orders()));
        ESTUARY_RETURN_IF_ERROR(accountant->AddRoundRdp(rdp));
        row.dp_clip = secagg.dp.clip;
      }
      // The weighted mean, folded as one update of the included sites' weight
      // (lora: the mean upload, the global adapter's tensors plus the mean movement).
      std::vector<float> mean = sum.mean;
      if (lora_reference) {
        for (size_t j = 0; j < mean.size(); ++j) mean[j] += lora_reference->values[j];
      }
      ESTUARY_RETURN_IF_ERROR(strategy.Fold(mean, sum.included_weight));
      for (size_t j : sum.included) received(updates[secagg_update[j]]->value());
      row.secagg_bytes_per_site = sum.bytes_per_site;
      row.secagg_seconds = sum.seconds;
      row.secagg_dropouts = sum.dropouts;
      row.secagg_dropouts_by_stage = {sum.dropouts_by_stage.begin(), sum.dropouts_by_stage.end()};
      row.secagg_error_bound = sum.error_bound;
    }
    updates.clear();
    // The mean, as the server reports it: sites of other ranks upload more.
    if (row.updates_received == 0) return FailedPrecondition("sim: round {}: every update was refused", round);
    row.bytes_per_update = row.bytes_up / row.updates_received;
    ESTUARY_RETURN_IF_ERROR(strategy.Finish(global));
    bound.CommitRound();
    if (accountant) {
      if (!distributed_dp) ESTUARY_RETURN_IF_ERROR(accountant->AddRounds(sampling_rate, dp.noise_multiplier()));
      row.epsilon = accountant->Spent().epsilon;
      if (const auto* dp_strategy = dynamic_cast<const aggregation::DpFedAvg*>(&strategy)) {
        row.dp_clip = dp_strategy->last_round().clip;
      }
    }
    row.merge_bytes_down = strategy.changed_bytes();
    ESTUARY_ASSIGN_OR_RETURN(const models::EvalResult eval, sim.federation.evaluator->Evaluate(global));
    row.train_loss = loss_sum / examples;
    row.test_accuracy = eval.accuracy;
    row.test_loss = eval.loss;
    row.global_checksum = crypto::Sha256Hex(global.data(), global.size() * sizeof(float));
    row.seconds = Since(round_start);
    row.sim_time = sim_time;
    if (ranks) row.mpi_bytes = ranks->bytes() - mpi_bytes_before;
    if (server::EvaluationDue(round, s.evaluate_every, s.rounds)) {
      SetFederated(row, EvaluateOnSites(sim.clients.names, sim.clients.trainers, s.evaluate_clients, global, manifest,
                                        task, round, s.threads));
    }
    report.rounds.push_back(row);
    if (on_round) on_round(row, s.rounds);
  }
  if (report.rounds.empty()) {
    return FailedPrecondition("sim: dp_max_epsilon {:g} admits no round at noise multiplier {:g}", dp.max_epsilon(),
                              dp.noise_multiplier());
  }
  if (accountant) {
    report.epsilon = accountant->Spent().epsilon;
    report.delta = accountant->delta();
  }
  report.total_seconds = Since(start);
  report.final_accuracy = report.rounds.back().test_accuracy;
  report.peak_rss_bytes = PeakResidentBytes();
  if (ranks) report.updates_by_rank = ranks->updates_by_rank();
  if (final_global) *final_global = std::move(global);
  return report;
}

}  // namespace estuary::simulations
