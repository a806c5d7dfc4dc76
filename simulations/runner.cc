#include "simulations/runner.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <optional>
#include "base/asio.h"
#include <chrono>
#include <cstring>
#include <set>
#include <thread>

#include "aggregation/sampling.h"
#include "base/host_port.h"
#include "base/seed.h"
#include "client/agent.h"
#include "client/trainer.h"
#include "crypto/certs.h"
#include "crypto/sha256.h"
#include "crypto/tls.h"
#include "models/dataset.h"
#include "models/model.h"
#include "simulations/partition.h"
#include "simulations/server_process.h"

namespace estuary::simulations {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

static double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

nlohmann::json ScenarioJson(const Scenario& s) {
  return {{"clients", s.clients}, {"per_round", s.per_round}, {"rounds", s.rounds}, {"epochs", s.epochs},
          {"batch", s.batch}, {"lr", s.lr}, {"momentum", s.momentum}, {"weight_decay", s.weight_decay},
          {"model", s.model}, {"partition", s.partition}, {"strategy", s.strategy.name},
          {"server_lr", s.strategy.server_lr}, {"seed", s.seed}, {"mode", s.mode}, {"threads", s.threads},
          {"data", s.data_dir.string()}};
}

static std::vector<std::string> ClientNames(uint32_t n) {
  std::vector<std::string> names;
  for (uint32_t i = 0; i < n; ++i) names.push_back(fmt::format("client-{:03}", i));
  return names;
}

static client::TaskConfig TaskOf(const Scenario& s) {
  client::TaskConfig task;
  task.model = s.model;
  task.epochs = s.epochs;
  task.batch_size = s.batch;
  task.learning_rate = s.lr;
  task.momentum = s.momentum;
  task.weight_decay = s.weight_decay;
  task.seed = s.seed;
  return task;
}

// The clients' local datasets, split from the training set by the scenario.
static Result<std::vector<std::unique_ptr<client::Trainer>>> MakeTrainers(
    const Scenario& s, const std::shared_ptr<const models::Dataset>& train) {
  ESTUARY_ASSIGN_OR_RETURN(auto spec, ParsePartition(s.partition));
  ESTUARY_ASSIGN_OR_RETURN(auto parts, Partition(train->labels, train->num_classes, int(s.clients), spec,
                                                 MixSeed(s.seed, std::string_view("partition"))));
  std::vector<std::unique_ptr<client::Trainer>> trainers;
  for (auto& indices : parts) trainers.push_back(std::make_unique<client::ClassifierTrainer>(train, std::move(indices)));
  return trainers;
}

static Status CheckScenario(const Scenario& s) {
  if (s.clients == 0) return InvalidArgument("sim: --clients must be >= 1");
  if (!(s.per_round > 0)) return InvalidArgument("sim: --per-round {} must be > 0", s.per_round);
  if (s.rounds == 0) return InvalidArgument("sim: --rounds must be >= 1");
  if (s.threads == 0) return InvalidArgument("sim: --threads must be >= 1");
  return client::ValidateTask(TaskOf(s));
}

Result<Report> RunInproc(const Scenario& s, const RoundCallback& on_round) {
  ESTUARY_RETURN_IF_ERROR(CheckScenario(s));
  const auto start = Clock::now();
  ESTUARY_ASSIGN_OR_RETURN(auto train, models::LoadIdx(s.data_dir, models::Split::kTrain));
  ESTUARY_ASSIGN_OR_RETURN(auto test, models::LoadIdx(s.data_dir, models::Split::kTest));
  ESTUARY_ASSIGN_OR_RETURN(auto trainers,
                           MakeTrainers(s, std::make_shared<const models::Dataset>(std::move(train))));
  ESTUARY_ASSIGN_OR_RETURN(auto initial, models::MakeModel(s.model));
  ESTUARY_ASSIGN_OR_RETURN(auto strategy, aggregation::MakeStrategy(s.strategy));
  initial->Initialize(s.seed);
  std::vector<std::unique_ptr<models::Model>> eval_models;
  eval_models.push_back(std::move(initial));
  for (uint32_t t = 1; t < s.threads; ++t) {
    ESTUARY_ASSIGN_OR_RETURN(auto extra, models::MakeModel(s.model));
    eval_models.push_back(std::move(extra));
  }
  models::Model* model = eval_models.front().get();
  const models::Manifest manifest = model->manifest();
  std::vector<float> global(model->parameters().begin(), model->parameters().end());
  const auto names = ClientNames(s.clients);
  const client::TaskConfig task = TaskOf(s);

  Report report;
  report.scenario = ScenarioJson(s);
  report.mode = "inproc";
  for (uint64_t round = 1; round <= s.rounds; ++round) {
    const auto round_start = Clock::now();
    const size_t k = aggregation::ClientsPerRound(s.per_round, names.size());
    const auto selected = aggregation::SampleClients(names, k, s.seed, round);
    std::vector<std::optional<Result<client::Update>>> updates(k);
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t i; (i = next.fetch_add(1)) < k;) {
        const size_t client = std::stoul(selected[i].substr(7));
        updates[i] = trainers[client]->Train(global, manifest, task, round, selected[i]);
      }
    };
    std::vector<std::thread> pool;
    for (uint32_t t = 1; t < std::min<size_t>(s.threads, k); ++t) pool.emplace_back(work);
    work();
    for (auto& thread : pool) thread.join();

    // Fold in the sorted order of the names, whatever order training finished in.
    ESTUARY_RETURN_IF_ERROR(strategy->Begin(round, global));
    RoundReport row;
    row.round = round;
    row.clients_selected = uint32_t(k);
    double loss_sum = 0, examples = 0;
    for (size_t i = 0; i < k; ++i) {
      if (!updates[i]->ok()) return updates[i]->status();
      const client::Update& update = updates[i]->value();
      ESTUARY_RETURN_IF_ERROR(strategy->Fold(update.payload, double(update.num_examples)));
      ++row.updates_received;
      row.bytes_up += update.payload.size() * sizeof(float);
      row.bytes_down += manifest.byte_size();
      loss_sum += update.train_loss * double(update.num_examples);
      examples += double(update.num_examples);
    }
    updates.clear();
    ESTUARY_RETURN_IF_ERROR(strategy->Finish(global));
    const models::EvalResult eval =
        models::EvaluateParallel(eval_models, global, test.features.data(), test.labels.data(), test.size());
    row.train_loss = loss_sum / examples;
    row.test_accuracy = eval.accuracy;
    row.test_loss = eval.loss;
    row.global_checksum = crypto::Sha256Hex(global.data(), global.size() * sizeof(float));
    row.seconds = Since(round_start);
    report.rounds.push_back(row);
    if (on_round) on_round(row, s.rounds);
  }
  report.total_seconds = Since(start);
  report.final_accuracy = report.rounds.back().test_accuracy;
  return report;
}

namespace {

Status ProvisionCertificates(const fs::path& dir, const std::vector<std::string>& names) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return IoError("sim: {}: {}", dir.string(), ec.message());
  if (!fs::exists(dir / "ca.pem")) ESTUARY_RETURN_IF_ERROR(crypto::InitCa(dir));
  for (const auto& name : names) {
    if (!fs::exists(dir / (name + ".pem"))) ESTUARY_RETURN_IF_ERROR(crypto::IssueCertificate(dir, name));
  }
  return Status::Ok();
}

}  // namespace

Result<Report> RunLoopback(const Scenario& s, const RoundCallback& on_round) {
  ESTUARY_RETURN_IF_ERROR(CheckScenario(s));
  const auto start = Clock::now();
  const auto names = ClientNames(s.clients);
  const fs::path certs = s.workdir / "certs";
  std::vector<std::string> all = names;
  all.push_back("server");
  ESTUARY_RETURN_IF_ERROR(ProvisionCertificates(certs, all));
  spdlog::debug("loopback: certificates ready after {:.3f} s", Since(start));

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
    std::vector<std::string> args = {
        "serve", "--listen", "127.0.0.1:0", "--cert", (certs / "server.pem").string(), "--key",
        (certs / "server.key").string(), "--ca", (certs / "ca.pem").string(), "--db", db.string(),
        "--eval-data", s.data_dir.string(), "--rounds", std::to_string(s.rounds), "--clients-per-round",
        fmt::format("{}", s.per_round), "--min-clients", std::to_string(s.clients), "--model", s.model,
        "--epochs", std::to_string(s.epochs), "--batch", std::to_string(s.batch), "--lr", fmt::format("{}", s.lr),
        "--momentum", fmt::format("{}", s.momentum), "--weight-decay", fmt::format("{}", s.weight_decay),
        "--seed", std::to_string(s.seed), "--strategy", s.strategy.name, "--server-lr",
        fmt::format("{}", s.strategy.server_lr), "--exit-when-done", "true", "--log-level", "info"};
    const fs::path log = s.workdir / "server.log";
    // The server starts while this process loads its data and certificates.
    ESTUARY_RETURN_IF_ERROR(server.Spawn(binary, args, log));
  } else {
    if (Status parsed = ParseHostPort(s.server, &host, &port); !parsed.ok()) {
      return InvalidArgument("sim: --server: {}", parsed.message());
    }
    db = s.round_log;
  }

  ESTUARY_ASSIGN_OR_RETURN(auto train, models::LoadIdx(s.data_dir, models::Split::kTrain));
  ESTUARY_ASSIGN_OR_RETURN(auto trainers,
                           MakeTrainers(s, std::make_shared<const models::Dataset>(std::move(train))));
  boost::asio::io_context io;
  boost::asio::thread_pool training(s.threads);
  Report report;
  report.scenario = ScenarioJson(s);
  report.mode = "loopback";
  report.round_log = db.empty() ? "" : fs::absolute(db).string();
  std::set<uint64_t> rounds_seen;
  size_t finished = 0;
  Status failure;
  std::vector<std::shared_ptr<client::Agent>> agents;
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
    options.label = names[i];
    auto agent = std::make_shared<client::Agent>(io, options, *trainers[i], training.get_executor());
    agent->on_round_closed = [&](const v1::RoundClosed& closed) {
      if (!closed.committed() || !rounds_seen.insert(closed.round()).second) return;
      RoundReport row;
      row.round = closed.round();
      row.clients_selected = closed.clients_selected();
      row.updates_received = closed.updates_received();
      row.test_accuracy = closed.test_accuracy();
      row.test_loss = closed.test_loss();
      row.train_loss = closed.train_loss();
      row.seconds = closed.seconds();
      row.bytes_up = closed.bytes_up();
      row.bytes_down = closed.bytes_down();
      row.global_checksum = closed.model_checksum();
      report.rounds.push_back(row);
      if (on_round) on_round(row, s.rounds);
    };
    agent->on_finished = [&](const Status& status) {
      if (!status.ok() && failure.ok()) failure = status;
      ++finished;
    };
    agents.push_back(agent);
  }
  for (auto& agent : agents) agent->Start();

  // A dead server would leave the agents reconnecting forever: watch it.
  boost::asio::steady_timer watchdog(io);
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
  report.total_seconds = Since(start);
  report.final_accuracy = report.rounds.back().test_accuracy;
  return report;
}

}  // namespace estuary::simulations
