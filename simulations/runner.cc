#include "simulations/runner.h"

#include <google/protobuf/util/json_util.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include "base/asio.h"
#include "base/atomic_file.h"
#include <chrono>
#include <cstring>
#include <map>
#include <set>
#include <thread>

#include "aggregation/dp_fedavg.h"
#include "aggregation/lora_strategy.h"
#include "aggregation/robust_strategy.h"
#include "aggregation/scaffold.h"
#include "aggregation/sampling.h"
#include "base/host_port.h"
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
#include "privacy/accountant.h"
#include "server/store.h"
#include "models/model.h"
#include "models/text_corpus.h"
#include "simulations/attack.h"
#include "simulations/instruction_sites.h"
#include "simulations/partition.h"
#include "simulations/poisson_sampling.h"
#include "simulations/scenario_checks.h"
#include "simulations/server_process.h"
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
          {"topics", s.topics}, {"mode", s.mode}, {"threads", s.threads}, {"data", s.data_dir.string()},
          {"device", s.device}, {"precision", s.precision}, {"lora_site_ranks", s.lora_site_ranks},
          {"lora_base_dtype", s.lora_base_dtype}, {"tokenizer", s.tokenizer.string()},
          {"partition_by", s.partition_by}, {"dirichlet", s.dirichlet_alpha}, {"label_field", s.label_field},
          {"attack", s.attack}, {"attackers", s.attackers}, {"recompute", s.recompute},
          {"stragglers", s.stragglers}, {"straggler_work", s.straggler_work}, {"dp", s.dp}};
  if (s.secagg) {
    const SecAggOptions& o = s.secagg_options;
    out["secagg"] = {{"neighbours", o.neighbours}, {"threshold", o.threshold}, {"bits", o.bits}, {"clip", o.clip},
                     {"dropout", o.dropout}, {"dp_survivors", o.dp.survivors}};
  }
  return out;
}

// The clients, plus the federation as the server builds it.
struct Simulation {
  Workload clients;
  aggregation::Federation federation;
};

static Result<Simulation> MakeSimulation(const Scenario& given) {
  Simulation sim;
  // On a Hugging Face base the clients build the model the task names after it.
  Scenario s = given;
  ESTUARY_RETURN_IF_ERROR(aggregation::ApplyHfBase(&s.federation).status());
  ESTUARY_ASSIGN_OR_RETURN(sim.clients, ClientsOf(s));
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

Result<Report> RunInproc(const Scenario& s, const RoundCallback& on_round, std::vector<float>* final_global) {
  ESTUARY_RETURN_IF_ERROR(CheckScenario(s));
  const auto start = Clock::now();
  ESTUARY_ASSIGN_OR_RETURN(Simulation sim, MakeSimulation(s));
  const Manifest& manifest = sim.federation.manifest;
  std::vector<float>& global = sim.federation.initial;
  aggregation::Strategy& strategy = *sim.federation.strategy;
  const auto& names = sim.clients.names;
  std::map<std::string, size_t> index_of;
  for (size_t i = 0; i < names.size(); ++i) index_of[names[i]] = i;
  const v1::TaskConfig& task = sim.federation.config.task();  // what the server would send every site

  Report report;
  report.scenario = ScenarioJson(s);
  report.mode = "inproc";
  // DP: the server's accountant, with q = sampled / clients.
  const v1::DpConfig dp = s.federation.dp();
  const bool distributed_dp = s.dp == "distributed";
  SecAggOptions secagg = s.secagg_options;
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
  const std::vector<bool> malicious = ChooseAttackers(uint32_t(names.size()), s.attackers, task.seed());
  if (attack.kind != Attack::Kind::kNone) report.attackers = std::count(malicious.begin(), malicious.end(), true);
  // SCAFFOLD: the server's c travels down with the model, each site's Δc up
  // with its delta, and each site keeps its c_i here, by site.
  auto* scaffold = dynamic_cast<aggregation::Scaffold*>(&strategy);
  std::vector<client::SiteControl> site_controls(scaffold ? names.size() : 0);
  for (uint64_t round = 1; round <= s.rounds; ++round) {
    const auto round_start = Clock::now();
    // Poisson sampling (--sample-rate q): each site joins with probability q;
    // otherwise a fixed number, and the accountant is told q = k / N.
    const bool poisson = s.sample_rate > 0;
    const auto selected =
        poisson ? PoissonSample(names, s.sample_rate, task.seed(), round)
                : aggregation::SampleClients(names, aggregation::ClientsPerRound(s.per_round, names.size()),
                                             task.seed(), round);
    const size_t k = selected.size();
    const double sampling_rate = poisson ? s.sample_rate : double(k) / double(names.size());
    if (poisson && k < (s.secagg ? 2u : 1u)) {
      return FailedPrecondition("sim: round {}: --sample-rate {} drew {} of {} sites; a round needs {} (choose q · "
                                "sites well above it)",
                                round, s.sample_rate, k, names.size(), s.secagg ? 2 : 1);
    }
    // The fixed denominator: the sites sampled, or under Poisson sampling the expected q · N.
    const double expected = poisson ? s.sample_rate * double(names.size()) : double(k);
    secagg.dp.denominator = expected;
    if (poisson) {
      secagg.dp.expected_sites = expected;
      secagg.dp.max_sites = PoissonPlannedMaximum(uint32_t(names.size()), s.sample_rate);
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
    }
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t i; (i = next.fetch_add(1)) < k;) {
        const size_t site = index_of.at(selected[i]);
        client::Trainer& trainer = *sim.clients.trainers[site];
        updates[i] = scaffold ? site_controls[site].Train(trainer, global, manifest, task, round, selected[i], control)
                              : trainer.Train(global, manifest, task, round, selected[i]);
      }
    };
    std::vector<std::thread> pool;
    for (uint32_t t = 1; t < std::min<size_t>(s.threads, k); ++t) pool.emplace_back(work);
    work();
    for (auto& thread : pool) thread.join();

    // Fold in the sorted order of the names, whatever order training finished
    // in, each as the federation's limits admit it, as the server does.
    aggregation::UpdateBound& bound = sim.federation.bound;
    bound.BeginRound();
    strategy.PlanRound(k);
    ESTUARY_RETURN_IF_ERROR(strategy.Begin(round, global));
    RoundReport row;
    row.round = round;
    row.clients_selected = uint32_t(k);
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
      const size_t site = index_of.at(selected[i]);
      if (malicious[site]) ++*row.attackers;  // its trainer attacked (workload.cc)
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
  if (final_global) *final_global = std::move(global);
  return report;
}

namespace {

// The server's noise is its own: a loopback run's ε comes from its round log,
// and so do a secure aggregation's bytes (framed, sent + received, per site) and dropouts.
Status AddPrivacyFromRoundLog(Report& report) {
  ESTUARY_ASSIGN_OR_RETURN(auto store, server::Store::OpenReadOnly(report.round_log));
  ESTUARY_ASSIGN_OR_RETURN(const std::vector<server::RoundRecord> logged, store->Rounds());
  std::map<uint64_t, server::RoundPrivacy> privacy;
  std::map<uint64_t, server::RoundSecAgg> secagg;
  for (const auto& r : logged) {
    if (r.state == server::RoundState::kCommitted && r.privacy) privacy[r.round] = *r.privacy;
    if (r.state == server::RoundState::kCommitted && r.secagg) secagg[r.round] = *r.secagg;
  }
  for (RoundReport& row : report.rounds) {
    if (auto a = secagg.find(row.round); a != secagg.end() && a->second.sites > 0) {
      uint64_t bytes = 0, dropouts = 0;
      for (int i = 0; i < 4; ++i) {
        bytes += a->second.bytes_up[i] + a->second.bytes_down[i];
        dropouts += a->second.dropouts[i];
      }
      row.secagg_bytes_per_site = bytes / a->second.sites;
      row.secagg_dropouts = dropouts;
    }
    auto it = privacy.find(row.round);
    if (it == privacy.end()) continue;
    row.epsilon = it->second.epsilon;
    row.dp_clip = it->second.clip;
    report.epsilon = it->second.epsilon;
    report.delta = it->second.delta;
  }
  return Status::Ok();
}

// The sites' certificates (client authentication), or with `role` kServer the
// server's, for the loopback addresses the sites dial. One already in `dir`
// is kept if it plays that role; one that does not (a workdir from before
// certificate roles: both usages) is issued anew.
Status ProvisionCertificates(const fs::path& dir, const std::vector<std::string>& names,
                             crypto::CertRole role = crypto::CertRole::kSite) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return IoError("sim: {}: {}", dir.string(), ec.message());
  if (!fs::exists(dir / "ca.pem")) ESTUARY_RETURN_IF_ERROR(crypto::InitCa(dir));
  std::map<std::string, std::string> roles;
  ESTUARY_ASSIGN_OR_RETURN(auto listed, crypto::ListCertificates(dir));
  for (const auto& cert : listed) {
    if (cert.state == crypto::CertificateStatus::State::kValid) roles[cert.name] = cert.role;
  }
  const std::string wanted = role == crypto::CertRole::kServer ? "server" : "site";
  for (const auto& name : names) {
    const fs::path pem = dir / (name + ".pem"), key = dir / (name + ".key");
    if (fs::exists(pem) && roles[name] == wanted) continue;
    fs::remove(pem, ec);
    fs::remove(key, ec);
    ESTUARY_RETURN_IF_ERROR(crypto::IssueCertificate(dir, name, {.role = role}));
  }
  return Status::Ok();
}

}  // namespace

Result<Report> RunLoopback(const Scenario& given, const RoundCallback& on_round) {
  ESTUARY_RETURN_IF_ERROR(CheckScenario(given));
  // On a Hugging Face base every site holds it (one copy, shared); the server sends none of it.
  Scenario s = given;
  ESTUARY_ASSIGN_OR_RETURN(const std::shared_ptr<const models::HfBase> hf_base, aggregation::ApplyHfBase(&s.federation));
  const auto start = Clock::now();
  const fs::path certs = s.workdir / "certs";
  ESTUARY_RETURN_IF_ERROR(ProvisionCertificates(certs, {"server"}, crypto::CertRole::kServer));

  // One site per value of a field, as many as the file holds, and the
  // examples held out of instruction data: known before the server starts.
  std::optional<Workload> loaded;
  uint32_t site_count = s.clients;
  if (site_count == 0 || InstructionData(s)) {
    ESTUARY_ASSIGN_OR_RETURN(loaded, ClientsOf(s));
    site_count = uint32_t(loaded->names.size());
  }
  ServerProcess server;
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  fs::path db = s.workdir / "rounds.db";
  if (s.server.empty()) {
    // A fresh federation every run: the round log and checkpoints start empty.
    for (const char* suffix : {"", "-wal", "-shm"}) fs::remove(db.string() + suffix);
    std::error_code ec;
    fs::remove_all(db.string() + ".checkpoints", ec);
    const fs::path binary = s.server_binary.empty() ? FindServerBinary() : s.server_binary;
    // The server builds the same federation from the same definition.
    v1::FederationConfig federation = FederationOf(s);
    if (!federation.base_model().empty()) federation.set_base_model(fs::absolute(federation.base_model()).string());
    const fs::path federation_file = s.workdir / "federation.txtpb";
    ESTUARY_RETURN_IF_ERROR(aggregation::WriteFederationFile(federation_file, federation));
    // The server scores what the in-process run's evaluator scores.
    fs::path eval_data = s.data_dir;
    if (InstructionData(s)) {
      eval_data = s.workdir / "held_out.jsonl";
      ESTUARY_RETURN_IF_ERROR(WriteFileAtomically(eval_data, loaded->held_out_jsonl));
    }
    std::vector<std::string> args = {
        "serve", "--listen", "127.0.0.1:0", "--cert", (certs / "server.pem").string(), "--key",
        (certs / "server.key").string(), "--ca", (certs / "ca.pem").string(), "--db", db.string(),
        "--eval-data", eval_data.string(), "--rounds", std::to_string(s.rounds), "--clients-per-round",
        fmt::format("{}", s.per_round), "--min-clients", std::to_string(site_count), "--federation",
        federation_file.string(), "--exit-when-done", "--log-level",
        // The server logs at this process's level, but never below info: its log file is the round's record.
        fmt::to_string(spdlog::level::to_string_view(std::min(spdlog::get_level(), spdlog::level::info)))};
    if (InstructionData(s)) args.insert(args.end(), {"--tokenizer", s.tokenizer.string()});
    if (s.secagg) {  // the sites take part when their RoundStart says so
      const SecAggOptions& o = s.secagg_options;
      args.insert(args.end(), {"--secagg", "--secagg-neighbours", std::to_string(o.neighbours), "--secagg-threshold",
                               std::to_string(o.threshold), "--secagg-bits", std::to_string(o.bits), "--secagg-clip",
                               fmt::format("{}", o.clip)});
    }
    const fs::path log = s.workdir / "server.log";
    // The server starts while this process loads its data and certificates.
    ESTUARY_RETURN_IF_ERROR(server.Spawn(binary, args, log));
  } else {
    if (Status parsed = ParseHostPort(s.server, &host, &port); !parsed.ok()) {
      return InvalidArgument("sim: --server: {}", parsed.message());
    }
    db = s.round_log;
  }
  if (!loaded) {
    ESTUARY_ASSIGN_OR_RETURN(loaded, ClientsOf(s));
  }
  Workload clients = std::move(*loaded);
  const auto& names = clients.names;
  auto& trainers = clients.trainers;
  ESTUARY_RETURN_IF_ERROR(ProvisionCertificates(certs, names));
  spdlog::debug("loopback: data and certificates ready after {:.3f} s", Since(start));

  boost::asio::io_context io;
  boost::asio::thread_pool training(s.threads);
  Report report;
  report.scenario = ScenarioJson(s);
  report.mode = "loopback";
  if (!s.attack.empty()) {
    const std::vector<bool> malicious = ChooseAttackers(uint32_t(names.size()), s.attackers, s.task().seed());
    report.attackers = std::count(malicious.begin(), malicious.end(), true);
  }
  report.round_log = db.empty() ? "" : fs::absolute(db).string();
  std::set<uint64_t> rounds_seen;
  size_t finished = 0;
  Status failure;
  std::vector<std::shared_ptr<client::Agent>> agents;
  boost::asio::steady_timer watchdog(io);
  // One client context for all sites (OpenSSL 3 makes each context costly);
  // each site presents its own certificate on its own connection.
  ESTUARY_ASSIGN_OR_RETURN(auto tls, crypto::MakeTrustOnlyClientContext(certs / "ca.pem"));
  std::vector<std::optional<Result<std::shared_ptr<const crypto::Identity>>>> identities(names.size());
  {
    std::atomic<size_t> next{0};
    auto load = [&] {
      for (size_t i; (i = next.fetch_add(1)) < names.size();) {
        identities[i] = crypto::LoadIdentity(certs / (names[i] + ".pem"), certs / (names[i] + ".key"));
      }
    };
    std::vector<std::thread> loaders;
    for (uint32_t t = 1; t < s.threads; ++t) loaders.emplace_back(load);
    load();
    for (auto& t : loaders) t.join();
  }
  spdlog::debug("loopback: data and {} identities ready after {:.3f} s", names.size(), Since(start));
  if (s.server.empty()) {
    ESTUARY_ASSIGN_OR_RETURN(port, server.WaitForPort());
    spdlog::debug("loopback: server listening after {:.3f} s", Since(start));
  }
  for (size_t i = 0; i < names.size(); ++i) {
    auto& identity = *identities[i];
    if (!identity.ok()) return identity.status();
    client::AgentOptions options;
    options.host = host;
    options.port = port;
    options.tls = tls;
    options.identity = *identity;
    options.keep_model = false;
    options.base = hf_base;
    options.label = names[i];
    auto agent = std::make_shared<client::Agent>(io, options, *trainers[i], training.get_executor());
    agent->on_round_closed = [&](const v1::RoundClosed& closed) {
      if (!closed.committed() || !rounds_seen.insert(closed.round()).second) return;
      const RoundReport row{
          .round = closed.round(), .clients_selected = closed.clients_selected(),
          .updates_received = closed.updates_received(), .test_accuracy = closed.test_accuracy(),
          .test_loss = closed.test_loss(), .train_loss = closed.train_loss(), .seconds = closed.seconds(),
          .bytes_up = closed.bytes_up(), .bytes_down = closed.bytes_down(),
          .bytes_per_update = closed.bytes_per_update(), .merge_bytes_down = closed.merge_bytes_down(),
          .global_checksum = closed.model_checksum()};
      report.rounds.push_back(row);
      if (on_round) on_round(row, s.rounds);
    };
    agent->on_finished = [&](const Status& status) {
      if (!status.ok() && failure.ok()) failure = status;
      // The last agent done: stop watching the server, or io.run() would
      // wait out the watchdog's pending period (up to 200 ms) before returning.
      if (++finished == agents.size()) watchdog.cancel();
    };
    agents.push_back(agent);
  }
  for (auto& agent : agents) agent->Start();

  // A dead server would leave the agents reconnecting forever: watch it.
  std::function<void()> watch = [&] {
    if (finished == agents.size()) return;
    if (auto code = server.Poll(); code && s.server.empty()) {
      failure = Aborted("sim: estuary-server exited with status {} before the federation completed; see {}", *code,
                        (s.workdir / "server.log").string());
      for (auto& agent : agents) agent->Stop();
      return;
    }
    watchdog.expires_after(std::chrono::milliseconds(200));
    watchdog.async_wait([&](const boost::system::error_code& ec) {
      if (!ec) watch();
    });
  };
  watch();
  io.run();
  training.join();
  if (!failure.ok()) return failure;
  if (s.server.empty()) {
    if (int code = server.Wait(); code != 0) {
      return Aborted("sim: estuary-server exited with status {}; see {}", code, (s.workdir / "server.log").string());
    }
  }
  if (report.rounds.empty()) return Aborted("sim: no round completed");
  std::sort(report.rounds.begin(), report.rounds.end(), [](auto& a, auto& b) { return a.round < b.round; });
  if (!report.round_log.empty()) ESTUARY_RETURN_IF_ERROR(AddPrivacyFromRoundLog(report));
  report.total_seconds = Since(start);
  report.final_accuracy = report.rounds.back().test_accuracy;
  return report;
}

}  // namespace estuary::simulations
