// estuary-sim: many federated clients on one machine.
//
//   estuary-sim [--config FILE] --clients N --per-round K --rounds R --epochs E --batch B --lr LR
//               --model mlp|cnn --partition iid|shards|dirichlet:ALPHA --strategy fedavg|fedadam
//               --seed S --mode inproc|loopback --report FILE
// The defaults are the flagship scenario: McMahan et al.'s 2NN on MNIST, 100
// IID clients, 10 per round, 5 local epochs of batch 10, lr 0.05, 20 rounds.
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>

#include "aggregation/federation_flags.h"
#include "base/cli.h"
#include "base/config_file.h"
#include "base/memory.h"
#include "models/checkpoint.h"
#include "proto/event_file.h"
#include "proto/frame.h"
#include "simulations/async_runner.h"
#include "simulations/instruct_fortunes.h"
#include "simulations/lora_fortunes.h"
#include "simulations/runner.h"
#include "simulations/sim_ranks.h"

extern "C" void openblas_set_num_threads(int);

namespace {

using namespace estuary;

int Fail(const Status& status) {
  std::fputc('\n', stderr);  // past the progress bar
  return estuary::Fail("estuary-sim", status);
}

void DrawProgress(uint64_t done, uint64_t total, double accuracy) {
  constexpr int kWidth = 30;
  const int filled = int(kWidth * done / total);
  std::fprintf(stderr, "\r[%s%s] round %llu/%llu  accuracy %.4f ", std::string(filled, '#').c_str(),
               std::string(kWidth - filled, '.').c_str(), (unsigned long long)done, (unsigned long long)total, accuracy);
  if (done == total) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

Status WriteJsonReport(const std::string& path, const nlohmann::json& json) {
  if (const auto parent = std::filesystem::path(path).parent_path(); !parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
  }
  return WriteFileAtomically(path, json.dump(2) + "\n");
}

// --scenario lora-fortunes: the flags it shares with a plain run keep their
// meaning (--data, --topics, --model, --rounds, --batch, --seq-len, --lr,
// --lora-*, --seed, --threads, --workdir, --report); unset ones take the
// scenario's defaults, not a plain run's.
int RunLoraFortunesScenario(const CLI::App& app, const simulations::Scenario& s, simulations::LoraFortunesOptions lf,
                            const std::string& report_path, bool quiet) {
  auto given = [&](const char* flag) { return app.get_option(flag)->count() > 0; };
  if (given("--data")) lf.data_dir = s.data_dir;
  if (given("--topics")) lf.topics = s.topics;
  const v1::TaskConfig& task = s.task();
  if (given("--model")) lf.model = task.model();
  if (given("--rounds")) lf.rounds = uint32_t(s.rounds);
  if (given("--batch")) lf.batch = task.batch_size();
  if (given("--seq-len")) lf.seq_len = task.seq_len();
  if (given("--lr")) lf.lr = task.learning_rate();
  if (given("--lora-rank")) lf.rank = task.lora().rank();
  if (given("--lora-alpha")) lf.alpha = task.lora().alpha();
  if (given("--lora-targets")) lf.targets = fmt::format("{}", fmt::join(task.lora().target_modules(), ","));
  if (given("--lora-merge")) lf.merges = {task.lora().merge()};
  if (given("--lora-base-dtype")) lf.lora_base_dtype = s.lora_base_dtype;
  lf.recompute = s.recompute;
  if (given("--eval-windows")) lf.eval_windows = s.federation.eval_windows();
  if (given("--workdir")) lf.workdir = s.workdir;
  if (given("--base-model")) lf.base_model = s.federation.base_model();
  lf.seed = task.seed();
  lf.threads = s.threads;
  auto progress = [&](const std::string& what) {
    if (!quiet) std::fprintf(stderr, "lora-fortunes: %s\n", what.c_str());
  };
  auto report = simulations::RunLoraFortunes(lf, progress);
  if (!report.ok()) return Fail(report.status());
  if (Status st = WriteJsonReport(report_path, simulations::ToJson(*report)); !st.ok()) return Fail(st);
  std::printf("%s\nheld-out perplexity per byte; %llu pretraining bytes (0: --base-model), %u rounds x %zu sites x %u steps = %llu "
              "centralised steps; %.1f s\nreport: %s\n",
              simulations::RenderLoraFortunes(*report).c_str(), (unsigned long long)report->pretrain_tokens, lf.rounds,
              report->sites.size(), lf.local_steps, (unsigned long long)report->central_steps, report->total_seconds,
              report_path.c_str());
  return 0;
}

// --scenario instruct-fortunes: as lora-fortunes, plus --template and
// --lora-merge (one rule).
int RunInstructFortunesScenario(const CLI::App& app, const simulations::Scenario& s,
                                const simulations::LoraFortunesOptions& lf, const std::string& report_path, bool quiet) {
  auto given = [&](const char* flag) { return app.get_option(flag)->count() > 0; };
  simulations::InstructFortunesOptions o;
  const v1::TaskConfig& task = s.task();
  if (given("--data")) o.data_dir = s.data_dir;
  if (given("--topics")) o.topics = s.topics;
  if (given("--model")) o.model = task.model();
  if (given("--rounds")) o.rounds = uint32_t(s.rounds);
  if (given("--batch")) o.batch = task.batch_size();
  if (given("--seq-len")) o.seq_len = task.seq_len();
  if (given("--lr")) o.lr = task.learning_rate();
  if (given("--lora-rank")) o.rank = task.lora().rank();
  if (given("--lora-alpha")) o.alpha = task.lora().alpha();
  if (given("--lora-targets")) o.targets = fmt::format("{}", fmt::join(task.lora().target_modules(), ","));
  if (given("--lora-merge")) o.merge = task.lora().merge();
  if (given("--template")) o.prompt_template = task.prompt_template();
  if (given("--eval-windows")) o.eval_windows = s.federation.eval_windows();
  if (given("--workdir")) o.workdir = s.workdir;
  if (given("--base-model")) o.base_model = s.federation.base_model();
  if (given("--pretrain-steps")) o.pretrain_steps = lf.pretrain_steps;
  if (given("--local-steps")) o.local_steps = lf.local_steps;
  o.recompute = s.recompute;
  o.seed = task.seed();
  o.threads = s.threads;
  auto progress = [&](const std::string& what) {
    if (!quiet) std::fprintf(stderr, "instruct-fortunes: %s\n", what.c_str());
  };
  auto report = simulations::RunInstructFortunes(o, progress);
  if (!report.ok()) return Fail(report.status());
  if (Status st = WriteJsonReport(report_path, simulations::ToJson(*report)); !st.ok()) return Fail(st);
  std::printf("%s\nheld-out response loss (nats per scored token); %u rounds x %zu sites x %u steps; %.1f s\n"
              "report: %s\n",
              simulations::RenderInstructFortunes(*report).c_str(), o.rounds, report->sites.size(), o.local_steps,
              report->total_seconds, report_path.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  estuary::proto::QuietProtobufLog();
  // Under mpirun (docs/PERFORMANCE.md, "Beyond one machine"): rank 0 runs the
  // simulation and reports; the others train their share of each round.
  std::unique_ptr<simulations::SimRanks> ranks;
  if (simulations::SimRanks::LaunchedByMpi()) {
    auto joined = simulations::SimRanks::Join(&argc, &argv);
    if (!joined.ok()) return Fail(joined.status());
    ranks = std::move(*joined);
  }
  // Clients train in parallel, one per thread; BLAS must not oversubscribe the cores.
  RetainFreedMemory();
  openblas_set_num_threads(1);
  CLI::App app{"estuary-sim: a federation of many clients on one machine"};
  ShowDefaultsInHelp(app);
  simulations::Scenario s;
  std::string config, report_path = "run/report.json", plot_path, log_level = "warn", tensorboard;
  bool quiet = false;
  std::string scenario;
  simulations::LoraFortunesOptions lf;
  app.add_option("--config", config, "TOML file with the same keys as these flags");
  app.add_option("--scenario", scenario,
                 "a built-in study instead of one run: lora-fortunes (pretrain a base on some fortunes topics, "
                 "then LoRA-federate the others under naive, exact and frozen-a, against centralised LoRA); "
                 "instruct-fortunes (the same base, then LoRA instruction tuning of sites whose prompts are built "
                 "from the other topics, against each site alone)");
  app.add_option("--pretrain-steps", lf.pretrain_steps, "scenarios: central pretraining steps of the base");
  app.add_option("--local-steps", lf.local_steps, "scenarios: local steps per site per round");
  app.add_option("--clients", s.clients, "number of clients");
  app.add_option("--sites", s.clients,
                 "instruction data (--data FILE.jsonl): number of sites, as --clients (--partition-by FIELD: "
                 "default one per value)");
  app.add_option("--per-round", s.per_round, "clients per round: count (>= 1) or fraction (< 1)");
  app.add_option("--sample-rate", s.sample_rate,
                 "Poisson sampling instead of --per-round: each client joins a round with this probability, "
                 "the q the privacy accountant uses (DP then divides by the expected q · clients); loopback starts "
                 "its server with it");
  app.add_option("--rounds", s.rounds, "federated rounds");
  app.add_option("--partition", s.partition, "iid | shards | dirichlet:ALPHA (images); topic (text)");
  app.add_option("--examples-per-client", s.examples_per_client,
                 "images: each client draws this many examples of its own under --partition (clients share "
                 "examples), made only when sampled, so --clients may be millions; 0 splits the training set");
  app.add_option("--tokenizer", s.tokenizer, "instruction data (--data FILE.jsonl): the sites' tokenizer.json");
  app.add_option("--partition-by", s.partition_by, "instruction data: one site per distinct value of this field");
  app.add_option("--dirichlet", s.dirichlet_alpha,
                 "instruction data: split among --sites by Dir(ALPHA) over the values of --label-field");
  app.add_option("--label-field", s.label_field, "instruction data, --dirichlet: the field whose values are the labels");
  app.add_option("--topics", s.topics, "text: comma-separated topics the clients hold (default: the first --clients)");
  app.add_option("--device", s.device, "where clients train: cpu | cuda | cuda:N");
  app.add_option("--precision", s.precision, "fp32 | bf16 | fp16 (bf16 and fp16 need cuda)");
  app.add_option("--lora-site-ranks", s.lora_site_ranks, "lora, exact only: the sites' own ranks, e.g. 4,8,16 (client i takes entry i mod n)");
  app.add_option("--lora-base-dtype", s.lora_base_dtype,
                 "lora: the sites keep the frozen base in f32 | bf16 (CPU: half the memory, trains on the rounded base)");
  app.add_flag("--recompute", s.recompute,
               "language models: the sites recompute each block's activations in backward (one block's "
               "activations in memory, about one more forward per step)");
  app.add_option("--mode", s.mode, "inproc | loopback");
  app.add_option("--attack", s.attack,
                 "inproc: what malicious sites upload: sign-flip[:L] (-L x delta) | scale:L | gaussian:S (noise) | nan | label-flip");
  app.add_option("--attackers", s.attackers, "inproc: the fraction of sites that are malicious (seeded), with --attack");
  app.add_option("--stragglers", s.stragglers,
                 "image federations: the fraction of sites (seeded) that run only part of their local steps each round");
  app.add_option("--straggler-work", s.straggler_work,
                 "MIN:MAX, the share of its full local steps a straggler runs, drawn per round and site");
  app.add_option("--data", s.data_dir,
                 "MNIST IDX directory (scripts/fetch-mnist makes it); for text models a fortunes directory, or a JSON "
                 "Lines file of instruction examples (with --template, --tokenizer, --partition-by or --dirichlet)");
  app.add_flag("--secagg", s.secagg,
               "each round's mean through SecAgg+ (quantised, masked, summed; in loopback mode by the server over the "
               "sites' sessions; docs/SECAGG.md)");
  app.add_option("--secagg-neighbours", s.secagg_options.neighbours,
                 "--secagg: neighbours k per site, even and < sites a round, or sites - 1 (0: about 3 log2 n)");
  app.add_option("--secagg-threshold", s.secagg_options.threshold,
                 "--secagg: shares t that rebuild a secret, a strict majority of k (0: k/2 + 1)");
  app.add_option("--secagg-bits", s.secagg_options.bits, "--secagg: the ring Z/2^bits the sum is taken in, 2..32");
  app.add_option("--secagg-clip", s.secagg_options.clip,
                 "--secagg: L2 norm each update is clipped to before quantisation; the error per element is about "
                 "sites x clip / 2^(bits-1)");
  app.add_option("--dropout", s.dropout,
                 "probability that a sampled site drops out, at a stage drawn from the seed: after training or "
                 "mid-upload (its update not folded), or under --secagg at one of the protocol's four stages");
  app.add_option("--dp", s.dp,
                 "with --dp-noise-multiplier: central (DP-FedAvg noises the sum on the server) | distributed (each "
                 "site adds its share of discrete Gaussian noise before secure aggregation; needs --secagg)");
  app.add_option("--dp-survivors", s.secagg_options.dp.survivors,
                 "--dp distributed: the fraction of a round's sampled sites whose shares make the full noise; the "
                 "server refuses to unmask fewer inputs (default 1)");
  app.add_flag("--async", s.async,
               "asynchronous rounds (FedBuff): sites train continuously, a new model version every --buffer "
               "arrivals; --rounds counts versions (docs/HETEROGENEITY.md)");
  app.add_option("--buffer", s.buffer, "--async: K, the updates folded into each model version");
  app.add_option("--concurrency", s.concurrency, "--async: C, the sites training at once");
  app.add_option("--staleness-weight", s.staleness_weight,
                 "--async: constant | poly:A ((1+t)^-A) | hinge:A,B (1 up to B versions stale, then 1/(A(t-B)+1))");
  app.add_option("--max-staleness", s.max_staleness, "--async: refuse updates more versions stale than this (-1: none)");
  app.add_option("--threads", s.threads, "clients trained at once");
  app.add_option("--evaluate-every", s.evaluate_every,
                 "federated evaluation: every N rounds (and after the last) the sites score the global model on "
                 "their own held-out examples, reported beside the test accuracy (0: never)");
  app.add_option("--evaluate-clients", s.evaluate_clients,
                 "--evaluate-every: sites asked, count (>= 1) or fraction (< 1) (0: all)");
  app.add_option("--eval-split", s.eval_split,
                 "--evaluate-every: fraction of each site's examples held out of its training to evaluate on");
  app.add_option("--report", report_path, "JSON report to write");
  app.add_option("--plot", plot_path, "SVG accuracy plot (default: the report's path with .svg)");
  app.add_option("--tensorboard", tensorboard, "DIR: a TensorBoard event file of every round's scalars");
  app.add_option("--server", s.server, "loopback: attach to a running server HOST:PORT");
  app.add_option("--round-log", s.round_log, "loopback with --server: the server's round log, for the report");
  app.add_option("--workdir", s.workdir, "loopback: certificates, round log, checkpoints, server log");
  app.add_option("--server-binary", s.server_binary, "loopback: the estuary-server to start");
  app.add_flag("--quiet", quiet, "no progress bar or table");
  AddLogLevelFlag(app, &log_level);
  aggregation::AddFederationFlags(app, &s.federation);
  if (auto exit = ParseCommandLine(app, argc, argv, "estuary-sim")) return *exit;
  if (!config.empty()) {
    if (Status st = ApplyConfigFile(app, config); !st.ok()) return Fail(st);
  }
  if (!s.topics.empty() && app.get_option("--clients")->count() == 0) {
    // One client per named topic unless --clients says otherwise.
    s.clients = uint32_t(std::count(s.topics.begin(), s.topics.end(), ',') + 1);
  }
  if (!s.partition_by.empty() && app.get_option("--clients")->count() + app.get_option("--sites")->count() == 0) {
    s.clients = 0;  // one site per value
  }
  if (s.secagg && app.get_option("--max-norm-over-median")->count() == 0) {
    // The server never sees an update's norm under secure aggregation; the
    // sites clip to --secagg-clip instead of the default relative bound.
    s.federation.mutable_limits()->set_max_norm_over_median(0);
  }
  if (s.federation.strategy().total_sites() > 0 && s.federation.strategy().name() != "scaffold") {
    return Fail(InvalidArgument("sim: --total-sites with strategy {}: only scaffold takes it here (the simulator's "
                                "population is its --clients)",
                                s.federation.strategy().name()));
  }
  if (s.sample_rate > 0 && app.get_option("--per-round")->count() > 0) {
    return Fail(InvalidArgument("sim: --sample-rate and --per-round both choose a round's clients: give one"));
  }
  if (s.dp == "distributed" && app.get_option("--secagg-clip")->count() > 0) {
    return Fail(InvalidArgument("sim: --dp distributed clips each update to --dp-clip; --secagg-clip is for --secagg "
                                "without DP"));
  }
  if (!s.async) {
    for (const char* flag : {"--buffer", "--concurrency", "--staleness-weight", "--max-staleness"}) {
      if (app.get_option(flag)->count() > 0) return Fail(InvalidArgument("sim: {} is for --async", flag));
    }
  } else if (app.get_option("--per-round")->count() > 0) {
    return Fail(InvalidArgument("sim: --per-round is for synchronous rounds; --async keeps --concurrency sites "
                                "training"));
  }
  StartLogging("estuary-sim", log_level);
  if (ranks) {
    // A failure of any rank is rank 0's to report, in one line and its exit
    // code; the others end cleanly, lest mpirun kill rank 0 before it prints.
    if (Status st = simulations::CheckMpiScenario(s, s.async, scenario); !st.ok()) {
      return ranks->rank() == 0 ? Fail(st) : 0;
    }
    if (ranks->rank() != 0) {
      (void)simulations::ServeInprocRank(s, *ranks);
      return 0;
    }
  }
  if (!scenario.empty()) {
    if (scenario == "lora-fortunes") return RunLoraFortunesScenario(app, s, lf, report_path, quiet);
    if (scenario == "instruct-fortunes") return RunInstructFortunesScenario(app, s, lf, report_path, quiet);
    return Fail(InvalidArgument("--scenario '{}': expected lora-fortunes or instruct-fortunes", scenario));
  }
  if (s.mode != "inproc" && s.mode != "loopback") {
    return Fail(InvalidArgument("--mode '{}': expected inproc or loopback", s.mode));
  }
  if (!quiet) {
    const v1::TaskConfig& task = s.task();
    // Instruction data names its split; by a field, the file says how many sites.
    const std::string clients = s.clients == 0 ? std::string("sites") : fmt::format("{} clients", s.clients);
    const std::string split = !s.partition_by.empty() ? fmt::format("one per value of {}", s.partition_by)
                              : s.dirichlet_alpha > 0
                                  ? fmt::format("dirichlet:{} over {}", s.dirichlet_alpha, s.label_field)
                              : s.examples_per_client > 0
                                  ? fmt::format("{}, {} examples each", s.partition, s.examples_per_client)
                                  : s.partition;
    const std::string per_round = s.sample_rate > 0 ? fmt::format("each with probability {:g} a round", s.sample_rate)
                                                    : fmt::format("{:g} per round", s.per_round);
    std::printf("estuary-sim: %s, %s (%s), %s, %llu rounds, %u epochs, batch %u, lr %g, %s, %s%s\n",
                task.model().c_str(), clients.c_str(), split.c_str(), per_round.c_str(), (unsigned long long)s.rounds,
                task.epochs(), task.batch_size(), task.learning_rate(),
                task.update_kind() == v1::UPDATE_LORA
                    ? fmt::format("lora r={} alpha={} {} merge", task.lora().rank(), task.lora().alpha(),
                                  task.lora().merge())
                          .c_str()
                    : s.federation.strategy().name().c_str(),
                s.async ? fmt::format("{} async K={} C={} {}", s.mode, s.buffer, s.concurrency, s.staleness_weight).c_str()
                        : s.mode.c_str(),
                s.recompute ? ", activation recompute" : "");
    std::fputs(simulations::RenderRoundTableHeader().c_str(), stdout);
    std::fflush(stdout);
  }
  std::unique_ptr<proto::EventFile> events;
  if (!tensorboard.empty()) {
    auto created = proto::EventFile::Create(tensorboard, "sim");
    if (!created.ok()) return Fail(created.status());
    events = std::move(*created);
  }
  const bool tty = isatty(STDERR_FILENO);
  auto on_round = [&](const simulations::RoundReport& row, uint64_t total) {
    if (events) {
      std::map<std::string, double> scalars = {{"eval/accuracy", row.test_accuracy},
                                               {"eval/loss", row.test_loss},
                                               {"round/train_loss", row.train_loss},
                                               {"round/updates_received", double(row.updates_received)},
                                               {"round/seconds", row.seconds},
                                               {"round/bytes_up", double(row.bytes_up)},
                                               {"round/bytes_down", double(row.bytes_down)}};
      if (row.epsilon) scalars["privacy/epsilon"] = *row.epsilon;
      // --evaluate-every, inproc (loopback reads them from the round log at the end).
      if (row.federated_accuracy) scalars["federated/accuracy"] = *row.federated_accuracy;
      if (row.federated_loss) scalars["federated/loss"] = *row.federated_loss;
      if (Status written = events->WriteScalars(int64_t(row.round), scalars); !written.ok()) {
        std::fprintf(stderr, "estuary-sim: %s\n", written.message().c_str());
      }
    }
    if (quiet) return;
    if (tty) std::fprintf(stderr, "\r%80s\r", "");
    std::fputs(simulations::RenderRoundTable({row}).c_str(), stdout);
    std::fflush(stdout);
    if (tty) DrawProgress(row.round, total, row.test_accuracy);
  };
  if (const auto parent = std::filesystem::path(report_path).parent_path(); !parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
  }
  auto report = s.mode != "inproc" ? simulations::RunLoopback(s, on_round)  // either kind of round
                : s.async           ? simulations::RunAsync(s, on_round)
                                    : simulations::RunInproc(s, on_round, nullptr, ranks.get());
  if (!report.ok()) return Fail(report.status());
  if (Status st = simulations::WriteReport(report_path, *report); !st.ok()) return Fail(st);
  if (plot_path.empty()) plot_path = std::filesystem::path(report_path).replace_extension(".svg").string();
  const std::string svg = simulations::RenderSvgPlot({*report}, {fmt::format("{} {}", s.task().model(), s.mode)});
  if (FILE* f = std::fopen(plot_path.c_str(), "w")) {
    std::fwrite(svg.data(), 1, svg.size(), f);
    std::fclose(f);
  } else {
    return Fail(IoError("{}: cannot write the plot", plot_path));
  }
  std::printf("final test accuracy %.4f after %zu %s in %.2f s\n", report->final_accuracy, report->rounds.size(),
              s.async ? "versions" : "rounds", report->total_seconds);
  if (const auto& last = report->rounds.back(); last.sim_time) {
    std::printf("simulated time %.0f (local steps of a full-speed site)\n", *last.sim_time);
  }
  if (report->attackers) {
    uint64_t refused = 0;
    for (const auto& row : report->rounds) refused += row.updates_refused.value_or(0);
    std::printf("attack %s: %llu of %u sites malicious; %llu updates refused\n", s.attack.c_str(),
                (unsigned long long)*report->attackers, s.clients, (unsigned long long)refused);
  }
  if (s.secagg) {
    uint64_t bytes = 0, dropouts = 0;
    std::vector<uint64_t> by_stage(4, 0);
    double seconds = 0, bound = 0;
    bool timed = false, bounded = false;  // in process only: loopback's rounds run in the server
    for (const auto& row : report->rounds) {
      bytes += row.secagg_bytes_per_site.value_or(0);
      dropouts += row.secagg_dropouts.value_or(0);
      for (size_t i = 0; row.secagg_dropouts_by_stage && i < 4; ++i) by_stage[i] += (*row.secagg_dropouts_by_stage)[i];
      seconds += row.secagg_seconds.value_or(0);
      bound = std::max(bound, row.secagg_error_bound.value_or(0));
      timed |= row.secagg_seconds.has_value();
      bounded |= row.secagg_error_bound.has_value();
    }
    const double rounds = double(report->rounds.size());
    std::string line = fmt::format("secure aggregation: {:.0f} bytes per site", double(bytes) / rounds);
    if (timed) line += fmt::format(" and {:.3f} s per round", seconds / rounds);
    line += fmt::format("; {} dropouts", dropouts);
    if (bounded) line += fmt::format("; quantisation error <= {:.3g} per element", bound);
    std::printf("%s\n", line.c_str());
    if (dropouts > 0) {
      std::printf("secure aggregation dropouts: %llu before advertising keys, %llu after advertising, %llu after "
                  "sharing keys, %llu after the masked input\n",
                  (unsigned long long)by_stage[0], (unsigned long long)by_stage[1], (unsigned long long)by_stage[2],
                  (unsigned long long)by_stage[3]);
    }
  }
  if (!s.secagg && s.dropout > 0) {
    uint64_t sampled = 0;
    std::vector<uint64_t> by_stage(2, 0);
    for (const auto& row : report->rounds) {
      sampled += row.clients_selected;
      for (size_t i = 0; row.dropouts_by_stage && i < 2; ++i) by_stage[i] += (*row.dropouts_by_stage)[i];
    }
    std::printf("dropouts: %llu of %llu sampled sites (%llu after training, %llu mid-upload)\n",
                (unsigned long long)(by_stage[0] + by_stage[1]), (unsigned long long)sampled,
                (unsigned long long)by_stage[0], (unsigned long long)by_stage[1]);
  }
  if (!report->trained_on.empty()) std::printf("sites trained on %s\n", report->trained_on.c_str());
  if (report->epsilon) std::printf("differential privacy: epsilon %.4g at delta %g\n", *report->epsilon, *report->delta);
  if (!report->round_log.empty()) std::printf("round log: %s\n", report->round_log.c_str());
  if (report->mpi_ranks) {
    uint64_t bytes = 0;
    for (const auto& row : report->rounds) bytes += row.mpi_bytes.value_or(0);
    std::printf("mpirun: %llu ranks trained %s updates (rank 0 first); %.0f bytes between ranks per round\n",
                (unsigned long long)*report->mpi_ranks, fmt::format("{}", fmt::join(report->updates_by_rank, " + ")).c_str(),
                double(bytes) / double(report->rounds.size()));
  }
  std::printf("report: %s\nplot: %s\n", report_path.c_str(), plot_path.c_str());
  return 0;
}
