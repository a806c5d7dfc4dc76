#include "simulations/async_runner.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <memory>
#include <queue>
#include <random>
#include <thread>
#include <tuple>

#include "aggregation/fedbuff.h"
#include "base/asio.h"
#include "base/seed.h"
#include "crypto/sha256.h"
#include "simulations/attack.h"
#include "simulations/scenario_checks.h"
#include "simulations/stragglers.h"
#include "simulations/workload.h"

namespace estuary::simulations {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// One site's training, from the version it pulled to its arrival.
struct Job {
  double arrival = 0;   // on the simulated clock
  uint64_t number = 0;  // in the order jobs started; breaks ties, seeds the site's shuffling
  size_t site = 0;
  uint64_t version = 0;  // the model it trains from
  std::shared_ptr<std::future<Result<client::Update>>> update;
  bool operator>(const Job& o) const { return std::tie(arrival, number) > std::tie(o.arrival, o.number); }
};

}  // namespace

Status CheckAsyncScenario(const Scenario& s) {
  if (s.mode == "loopback" && s.stragglers > 0) {
    return InvalidArgument("sim: --async --mode loopback with --stragglers: a straggler is slower in simulated time, "
                           "which the real server does not keep; run it in process (--mode inproc)");
  }
  if (s.secagg) return InvalidArgument("sim: --async with --secagg: a masked sum needs a whole round's sites at once");
  if (!s.attack.empty()) return InvalidArgument("sim: --async with --attack: not supported");
  if (s.sample_rate > 0) return InvalidArgument("sim: --async with --sample-rate: sites are drawn as slots free up");
  if (s.examples_per_client > 0) {
    return InvalidArgument("sim: --async with --examples-per-client: asynchronous rounds hold every site; give the "
                           "sites the data's own partition");
  }
  if (s.buffer < 1) return InvalidArgument("sim: --buffer {}: expected K >= 1", s.buffer);
  if (s.max_staleness < -1) {
    return InvalidArgument("sim: --max-staleness {}: expected >= 0 (-1: none)", s.max_staleness);
  }
  if (s.concurrency < 1 || (s.clients > 0 && s.concurrency > s.clients)) {
    return InvalidArgument("sim: --concurrency {}: expected 1 to --clients ({})", s.concurrency, s.clients);
  }
  if (auto weight = aggregation::ParseStalenessWeight(s.staleness_weight); !weight.ok()) {
    return InvalidArgument("sim: --staleness-weight: {}", weight.status().message());
  }
  if (Status refused = aggregation::CheckFedBuffFederation(FederationOf(s)); !refused.ok()) {
    return InvalidArgument("sim: --async: {}", refused.message());
  }
  return Status::Ok();
}

Result<Report> RunAsync(const Scenario& given, const RoundCallback& on_round, std::vector<float>* final_global) {
  ESTUARY_RETURN_IF_ERROR(CheckAsyncScenario(given));
  if (given.mode != "inproc") {
    return InvalidArgument("sim: RunAsync runs in process; RunLoopback runs --async against the server");
  }
  ESTUARY_RETURN_IF_ERROR(CheckScenario(given));
  const auto start = Clock::now();
  // Stragglers run their full steps here, only slower: the sites' trainers are the honest ones.
  Scenario s = given;
  s.stragglers = 0;
  ESTUARY_RETURN_IF_ERROR(aggregation::ApplyHfBase(&s.federation).status());
  ESTUARY_ASSIGN_OR_RETURN(Workload clients, ClientsOf(s));
  const aggregation::EvaluationOptions evaluation{
      .data = InstructionData(s) ? std::filesystem::path() : s.data_dir, .threads = int(s.threads),
      .rows = clients.held_out};
  ESTUARY_ASSIGN_OR_RETURN(aggregation::Federation federation,
                           aggregation::MakeFederation(FederationOf(s), evaluation, aggregation::DpNoise::kSeeded));
  const auto& names = clients.names;
  if (s.concurrency > names.size()) {
    return InvalidArgument("sim: --concurrency {}: more than the {} sites", s.concurrency, names.size());
  }
  const Manifest& manifest = federation.manifest;
  const v1::TaskConfig& task = federation.config.task();
  const uint64_t seed = s.task().seed();
  ESTUARY_ASSIGN_OR_RETURN(const Stragglers stragglers, ParseStragglers(given.stragglers, given.straggler_work));
  const std::vector<bool> slow = ChooseSites(uint32_t(names.size()), stragglers.fraction, seed, "stragglers");

  ESTUARY_ASSIGN_OR_RETURN(const aggregation::StalenessWeight weight,
                           aggregation::ParseStalenessWeight(s.staleness_weight));
  const double server_lr = federation.config.strategy().server_lr();
  aggregation::FedBuffOptions options{.buffer = s.buffer, .server_lr = server_lr > 0 ? server_lr : 1.0,
                                      .weight = weight};
  if (s.max_staleness >= 0) options.max_staleness = uint64_t(s.max_staleness);
  ESTUARY_ASSIGN_OR_RETURN(aggregation::FedBuff fedbuff,
                           aggregation::FedBuff::Create(options, manifest.total_elements));
  std::vector<float>& global = federation.initial;
  aggregation::UpdateBound& bound = federation.bound;

  Report report;
  report.scenario = ScenarioJson(given);
  report.mode = "inproc-async";
  boost::asio::thread_pool pool(std::max<uint32_t>(s.threads, 1));
  std::mt19937_64 draw(MixSeed(seed, std::string_view("async sites")));
  std::vector<size_t> idle(names.size());
  for (size_t i = 0; i < idle.size(); ++i) idle[i] = i;
  std::priority_queue<Job, std::vector<Job>, std::greater<>> in_flight;
  auto snapshot = std::make_shared<const std::vector<float>>(global);  // the current version, shared by its jobs
  uint64_t jobs = 0;
  // Starts a site drawn from the idle ones on the current version at `now`.
  auto start_job = [&](double now) {
    const size_t pick = size_t(draw() % idle.size());
    const size_t site = idle[pick];
    idle.erase(idle.begin() + std::ptrdiff_t(pick));
    const uint64_t number = ++jobs;
    client::Trainer& trainer = *clients.trainers[site];
    const double speed = SiteSpeed(stragglers, slow[site], seed, number, uint32_t(site));
    const double steps = double(FullLocalSteps(task, trainer.num_examples()));
    auto promise = std::make_shared<std::promise<Result<client::Update>>>();
    Job job{.arrival = now + steps / speed, .number = number, .site = site, .version = fedbuff.version(),
            .update = std::make_shared<std::future<Result<client::Update>>>(promise->get_future())};
    boost::asio::post(pool, [&trainer, &manifest, &task, &names, promise, model = snapshot, number, site] {
      promise->set_value(trainer.Train(*model, manifest, task, number, names[site]));
    });
    in_flight.push(std::move(job));
  };
  for (uint32_t i = 0; i < s.concurrency; ++i) start_job(0.0);

  // The jobs still in flight when the run ends or fails hold the trainers: wait for them.
  struct Drain {
    boost::asio::thread_pool& pool;
    ~Drain() { pool.join(); }
  } drain{pool};

  RoundReport row;
  double loss_sum = 0, staleness_sum = 0;
  uint64_t refused = 0, staleness_max = 0;
  auto round_start = Clock::now();
  bound.BeginRound();
  while (fedbuff.version() < s.rounds) {
    // Every arrival of this instant is folded before the sites that arrived
    // start again, on the newest version (equal sites arrive together).
    const double now = in_flight.top().arrival;
    size_t arrived = 0;
    for (; !in_flight.empty() && in_flight.top().arrival == now && fedbuff.version() < s.rounds; ++arrived) {
      Job job = in_flight.top();
      in_flight.pop();
      ESTUARY_ASSIGN_OR_RETURN(client::Update update, job.update->get());
      const std::string& name = names[job.site];
      row.bytes_down += manifest.byte_size();
      row.bytes_up += update.payload.size() * sizeof(float);
      ++row.clients_selected;
      ESTUARY_ASSIGN_OR_RETURN(const aggregation::UpdateBound::Admitted admitted,
                               bound.Admit(update.payload, update.num_examples));
      if (!admitted.note().empty()) {
        spdlog::warn("version {}: update from {}: {}", fedbuff.version() + 1, name, admitted.note());
      }
      auto folded = fedbuff.Fold(admitted.values(), job.version);
      if (!folded.ok() && folded.status().code() == Code::kFailedPrecondition) {
        spdlog::debug("version {}: update from {} refused: {}", fedbuff.version() + 1, name,
                      folded.status().message());
        ++refused;
      } else {
        ESTUARY_RETURN_IF_ERROR(folded.status());
        ++row.updates_received;
        loss_sum += update.train_loss;
        staleness_sum += double(folded->staleness);
        staleness_max = std::max(staleness_max, folded->staleness);
        if (report.trained_on.empty()) report.trained_on = update.trained_on;
      }
      idle.push_back(job.site);
      if (folded.ok() && folded->full) {
        ESTUARY_RETURN_IF_ERROR(fedbuff.Step(global));
        bound.CommitRound();
        snapshot = std::make_shared<const std::vector<float>>(global);
        row.round = fedbuff.version();
        row.train_loss = loss_sum / double(row.updates_received);
        row.bytes_per_update = row.bytes_up / std::max<uint64_t>(row.clients_selected, 1);
        row.updates_refused = refused;
        row.staleness_mean = staleness_sum / double(row.updates_received);
        row.staleness_max = staleness_max;
        row.sim_time = job.arrival;
        if (federation.evaluator) {
          ESTUARY_ASSIGN_OR_RETURN(const models::EvalResult eval, federation.evaluator->Evaluate(global));
          row.test_accuracy = eval.accuracy;
          row.test_loss = eval.loss;
        }
        row.global_checksum = crypto::Sha256Hex(global.data(), global.size() * sizeof(float));
        row.seconds = Since(round_start);
        report.rounds.push_back(row);
        if (on_round) on_round(row, s.rounds);
        row = RoundReport{};
        loss_sum = staleness_sum = 0;
        refused = staleness_max = 0;
        round_start = Clock::now();
        bound.BeginRound();
      }
    }
    for (size_t i = 0; i < arrived && fedbuff.version() < s.rounds; ++i) start_job(now);
  }
  report.total_seconds = Since(start);
  report.final_accuracy = report.rounds.back().test_accuracy;
  if (final_global) *final_global = std::move(global);
  return report;
}

}  // namespace estuary::simulations
