// RunLoopback (runner.h): a real estuary-server and one mutual-TLS agent per site.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>
#include <set>

#include "base/asio.h"
#include "base/atomic_file.h"
#include "base/descriptors.h"
#include "base/host_port.h"
#include "client/agent.h"
#include "crypto/provision.h"
#include "crypto/tls.h"
#include "models/hf_base.h"
#include "server/store.h"
#include "simulations/async_runner.h"
#include "simulations/attack.h"
#include "simulations/federated_eval.h"
#include "simulations/instruction_sites.h"
#include "simulations/loopback_dropout.h"
#include "simulations/runner.h"
#include "simulations/scenario_checks.h"
#include "simulations/server_process.h"
#include "simulations/site_draws.h"
#include "simulations/workload.h"

namespace estuary::simulations {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

// Sites connecting at once, at most: the server's default for handshakes in
// flight from one address (ServerConfig::max_handshakes_per_address).
constexpr size_t kConnectingAtOnce = 128;
// Descriptors beyond one a site: files, the round log, the server's pipes.
constexpr size_t kSpareDescriptors = 256;

static double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

namespace {

// The server's noise is its own: a loopback run's ε comes from its round log,
// and so do a secure aggregation's bytes (framed, sent + received, per site)
// and dropouts (by stage, checked against what the sites were told:
// `ledger`, when they dropped by a draw; a plain round's from its
// participations, with `plain_dropout`), and the sites' federated evaluation.
Status AddPrivacyFromRoundLog(Report& report, const DropLedger* ledger, bool plain_dropout) {
  ESTUARY_ASSIGN_OR_RETURN(auto store, server::Store::OpenReadOnly(report.round_log));
  ESTUARY_ASSIGN_OR_RETURN(const std::vector<server::RoundRecord> logged, store->Rounds());
  std::map<uint64_t, server::RoundPrivacy> privacy;
  std::map<uint64_t, server::RoundSecAgg> secagg;
  std::map<uint64_t, server::RoundEvaluation> evaluation;
  for (const auto& r : logged) {
    if (r.state == server::RoundState::kCommitted && r.evaluation) evaluation[r.round] = *r.evaluation;
    if (r.state == server::RoundState::kCommitted && r.privacy) privacy[r.round] = *r.privacy;
    if (r.state == server::RoundState::kCommitted && r.secagg) secagg[r.round] = *r.secagg;
  }
  for (RoundReport& row : report.rounds) {
    if (auto e = evaluation.find(row.round); e != evaluation.end()) SetFederated(row, e->second);
    if (plain_dropout) {
      ESTUARY_ASSIGN_OR_RETURN(const std::vector<server::Participation> participations,
                               store->Participations(row.round));
      row.dropouts_by_stage = DropoutsByDrawnStage(participations);
      row.dropouts = (*row.dropouts_by_stage)[0] + (*row.dropouts_by_stage)[1];
      if (ledger) {
        if (auto differs = CompareWithDraw(row.round, *row.dropouts_by_stage, *ledger)) spdlog::warn("{}", *differs);
      }
    }
    if (auto a = secagg.find(row.round); a != secagg.end() && a->second.sites > 0) {
      uint64_t bytes = 0, dropouts = 0;
      for (int i = 0; i < 4; ++i) bytes += a->second.bytes_up[i] + a->second.bytes_down[i];
      for (uint32_t d : a->second.dropouts) dropouts += d;
      row.secagg_bytes_per_site = bytes / a->second.sites;
      row.secagg_dropouts = dropouts;
      row.secagg_dropouts_by_stage = DropoutsByDrawnStage(a->second);
      if (ledger) {
        if (auto differs = CompareWithDraw(row.round, *row.secagg_dropouts_by_stage, *ledger)) spdlog::warn("{}", *differs);
      }
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

// An asynchronous federation's versions are the server's: sites hear of no
// version's close, so its rows come from the round log, with the staleness of
// each version's folded arrivals.
Status AddVersionsFromRoundLog(Report& report, const RoundCallback& on_round, uint64_t planned) {
  ESTUARY_ASSIGN_OR_RETURN(auto store, server::Store::OpenReadOnly(report.round_log));
  ESTUARY_ASSIGN_OR_RETURN(const std::vector<server::RoundRecord> logged, store->Rounds());
  for (const server::RoundRecord& r : logged) {
    if (r.state != server::RoundState::kCommitted) continue;
    RoundReport row{.round = r.round, .clients_selected = r.clients_selected, .updates_received = r.updates_received,
                    .test_accuracy = r.test_accuracy.value_or(0), .test_loss = r.test_loss.value_or(0),
                    .train_loss = r.train_loss, .seconds = double(r.ended_ms - r.started_ms) / 1000,
                    .bytes_up = r.bytes_up, .bytes_down = r.bytes_down,
                    .bytes_per_update = r.bytes_up / std::max<uint64_t>(r.updates_received, 1),
                    .global_checksum = r.global_checksum};
    ESTUARY_ASSIGN_OR_RETURN(const std::vector<server::Arrival> arrivals, store->Arrivals(r.round));
    double staleness = 0;
    uint64_t folded = 0, largest = 0, refused = 0;
    for (const server::Arrival& a : arrivals) {
      if (a.status != "folded") {
        refused += a.status == "stale";
        continue;
      }
      ++folded;
      staleness += double(a.staleness);
      largest = std::max(largest, a.staleness);
    }
    row.staleness_mean = folded ? staleness / double(folded) : 0;
    row.staleness_max = largest;
    row.updates_refused = refused;
    report.rounds.push_back(row);
    if (on_round) on_round(row, planned);
  }
  return Status::Ok();
}

}  // namespace

Result<Report> RunLoopback(const Scenario& given, const RoundCallback& on_round) {
  ESTUARY_RETURN_IF_ERROR(CheckScenario(given));
  if (given.async) ESTUARY_RETURN_IF_ERROR(CheckAsyncScenario(given));
  // On a Hugging Face base every site holds it (one copy, shared); the server sends none of it.
  Scenario s = given;
  ESTUARY_ASSIGN_OR_RETURN(const std::shared_ptr<const models::HfBase> hf_base, aggregation::ApplyHfBase(&s.federation));
  const auto start = Clock::now();
  const fs::path certs = s.workdir / "certs";
  // The server's certificate names the loopback addresses the sites dial.
  ESTUARY_RETURN_IF_ERROR(crypto::ProvisionCertificates(certs, {"server"}, 1, {.role = crypto::CertRole::kServer}));

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
    // Under DP with Poisson sampling the mean divides by q · total_sites (and
    // distributed DP plans its shares for them): inproc's population is the
    // sites, and every one of them connects here.
    if (s.sample_rate > 0 && federation.dp().noise_multiplier() > 0) {
      federation.mutable_strategy()->set_total_sites(site_count);
    }
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
        "--eval-data", eval_data.string(), "--rounds", std::to_string(s.rounds), "--min-clients",
        std::to_string(site_count), "--federation",
        federation_file.string(), "--exit-when-done", "--log-level",
        // The server logs at this process's level, but never below info: its log file is the round's record.
        fmt::to_string(spdlog::level::to_string_view(std::min(spdlog::get_level(), spdlog::level::info)))};
    if (s.sample_rate > 0) {
      // Poisson sampling from the simulator's seed: the server's seeded draw
      // (aggregation::PoissonSampleClients) is inproc's PoissonSample, so each
      // round takes the sites the inproc run takes (a population's inproc draw,
      // PoissonSampleIndices, is another stream). --seed 0 leaves the draw to
      // the server's CSPRNG, which --sample-seed 0 means. Where inproc ends a
      // run on a draw too small for a round, the server draws again.
      args.insert(args.end(), {"--sample-rate", fmt::format("{}", s.sample_rate)});
      if (s.task().seed() != 0) args.insert(args.end(), {"--sample-seed", std::to_string(s.task().seed())});
    } else {
      args.insert(args.end(), {"--clients-per-round", fmt::format("{}", s.per_round)});
    }
    if (InstructionData(s)) args.insert(args.end(), {"--tokenizer", s.tokenizer.string()});
    if (s.evaluate_every > 0) {
      args.insert(args.end(), {"--evaluate-every", std::to_string(s.evaluate_every), "--evaluate-clients",
                               fmt::format("{}", s.evaluate_clients)});
    }
    if (s.async) {
      args.insert(args.end(), {"--mode", "async", "--buffer", std::to_string(s.buffer), "--concurrency",
                               std::to_string(s.concurrency), "--staleness-weight", s.staleness_weight,
                               fmt::format("--max-staleness={}", s.max_staleness)});
    }
    if (s.secagg) {  // the sites take part when their RoundStart says so
      const SecAggOptions& o = s.secagg_options;
      args.insert(args.end(), {"--secagg", "--secagg-neighbours", std::to_string(o.neighbours), "--secagg-threshold",
                               std::to_string(o.threshold), "--secagg-bits", std::to_string(o.bits), "--secagg-clip",
                               fmt::format("{}", o.clip)});
      // Distributed DP: the server plans the shares and tells each site its
      // variance in the RoundStart; the sites add them (client/secagg_site.cc).
      if (s.dp == "distributed") {
        args.insert(args.end(), {"--dp", "distributed", "--dp-survivors", fmt::format("{}", o.dp.survivors)});
      }
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
  ESTUARY_RETURN_IF_ERROR(crypto::ProvisionCertificates(certs, names, s.threads));
  spdlog::debug("loopback: data and certificates ready after {:.3f} s", Since(start));

  // This process holds one end of every site's connection (the server
  // raises its own limit for the other).
  ESTUARY_RETURN_IF_ERROR(EnsureDescriptors(names.size() + kSpareDescriptors));
  boost::asio::io_context io;
  boost::asio::thread_pool training(s.threads);
  Report report;
  report.scenario = ScenarioJson(s);
  report.mode = s.async ? "loopback-async" : "loopback";
  if (!s.attack.empty()) {
    report.attackers = ChosenSiteCount(names.size(), s.attackers);  // as ChooseAttackers and a population choose
  }
  report.round_log = db.empty() ? "" : fs::absolute(db).string();
  std::set<uint64_t> rounds_seen;
  size_t finished = 0;
  Status failure;
  std::vector<std::shared_ptr<client::Agent>> agents;
  // --dropout: the sites drop where inproc's seeded draw says (loopback_dropout.h).
  std::shared_ptr<DropLedger> dropped;
  if (s.dropout > 0) dropped = std::make_shared<DropLedger>();
  // One hook for all the sites (it holds the names once).
  std::function<client::UploadDrop(uint64_t, const std::string&)> upload_drop;
  if (dropped && !s.secagg) upload_drop = UploadDropHook(s.dropout, s.task().seed(), names, s.per_round, dropped);
  boost::asio::steady_timer watchdog(io);
  // One client context for all sites (OpenSSL 3 makes each context costly);
  // each site presents its own certificate on its own connection.
  ESTUARY_ASSIGN_OR_RETURN(auto tls, crypto::MakeTrustOnlyClientContext(certs / "ca.pem"));
  ESTUARY_ASSIGN_OR_RETURN(const auto identities, crypto::LoadIdentities(certs, names, s.threads));
  spdlog::debug("loopback: data and {} identities ready after {:.3f} s", names.size(), Since(start));
  if (s.server.empty()) {
    ESTUARY_ASSIGN_OR_RETURN(port, server.WaitForPort());
    spdlog::debug("loopback: server listening after {:.3f} s", Since(start));
  }
  for (size_t i = 0; i < names.size(); ++i) {
    client::AgentOptions options;
    options.host = host;
    options.port = port;
    options.tls = tls;
    options.identity = identities[i];
    options.keep_model = false;
    options.base = hf_base;
    options.label = names[i];
    if (dropped) {
      if (s.secagg) {
        options.secagg_drop = SecAggDropHook(s.dropout, s.task().seed(), dropped);
      } else {
        options.upload_drop = upload_drop;
      }
      // A site that dropped on purpose comes back at once: the server opens
      // the next round only when every site is connected (--min-clients),
      // and the default backoff (0.25 s, doubling) would hold it open for
      // nothing. A connection that really fails still backs off, from 10 ms.
      options.initial_backoff_s = 0.01;
    }
    options.secagg_keep_dir = s.secagg_keep_dir;
    // SCAFFOLD: each site keeps its own c_i, in memory, as in process.
    if (s.federation.strategy().name() == "scaffold") options.scaffold = std::make_shared<client::SiteControl>();
    auto agent = std::make_shared<client::Agent>(io, options, *trainers[i], training.get_executor());
    agent->on_round_closed = [&](const v1::RoundClosed& closed) {
      // An asynchronous federation's versions come from its round log; the
      // only RoundClosed its sites hear is the federation's end.
      if (s.async || !closed.committed() || !rounds_seen.insert(closed.round()).second) return;
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
  // At most kConnectingAtOnce sites connect at a time, the next as one is
  // welcomed: every site dials from 127.0.0.1, and the server closes at once
  // a connection beyond its handshakes in flight from one address, which
  // would send the rest into their reconnect backoff (up to 30 s).
  // A site that finishes without ever being welcomed (refused for good)
  // makes room the same way.
  size_t next_to_start = 0;
  std::vector<bool> welcomed(agents.size(), false);
  auto make_room = [&](size_t i) {
    if (welcomed[i]) return;
    welcomed[i] = true;
    if (next_to_start < agents.size()) agents[next_to_start++]->Start();
  };
  for (size_t i = 0; i < agents.size(); ++i) {
    agents[i]->on_welcome = [&make_room, i] { make_room(i); };
    agents[i]->on_finished = [&make_room, i, finished = std::move(agents[i]->on_finished)](const Status& status) {
      finished(status);
      make_room(i);
    };
  }
  while (next_to_start < std::min(agents.size(), kConnectingAtOnce)) agents[next_to_start++]->Start();

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
  if (s.async && !report.round_log.empty()) ESTUARY_RETURN_IF_ERROR(AddVersionsFromRoundLog(report, on_round, s.rounds));
  if (report.rounds.empty()) return Aborted("sim: no round completed");
  std::sort(report.rounds.begin(), report.rounds.end(), [](auto& a, auto& b) { return a.round < b.round; });
  if (!report.round_log.empty()) ESTUARY_RETURN_IF_ERROR(AddPrivacyFromRoundLog(report, dropped.get(), dropped && !s.secagg));
  report.total_seconds = Since(start);
  report.final_accuracy = report.rounds.back().test_accuracy;
  return report;
}

}  // namespace estuary::simulations
