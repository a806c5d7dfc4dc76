// estuary-client: one federation site. Connects to the aggregation server
// over mutual TLS, trains when selected, uploads its update, and reconnects
// with backoff when the server goes away, until the federation completes.
// With --ranks N or --gpus the site trains on several ranks (client/launch.h
// starts them, client/site.h runs them) and is still one client.
#include <spdlog/spdlog.h>
#include <sys/wait.h>

#include "base/asio.h"
#include <cstdio>
#include <map>
#include <numeric>
#include <thread>

#include "base/cli.h"
#include "base/config_file.h"
#include "base/host_port.h"
#include "base/seed.h"
#include "base/memory.h"
#include "client/agent.h"
#include "models/hf_base.h"
#include "comm/gloo_communicator.h"
#include "client/held_out.h"
#include "client/launch.h"
#include "client/site.h"
#include "crypto/tls.h"
#include "client/compute.h"
#include "models/dataset.h"
#include "models/text_corpus.h"
#include "proto/frame.h"
#ifdef ESTUARY_HAVE_CUDA
#include "models/cuda/device.h"
#endif
#ifdef ESTUARY_HAVE_NCCL
#include "comm/nccl_communicator.h"
#endif

extern "C" void openblas_set_num_threads(int);

namespace {

using namespace estuary;

int Fail(const Status& status) { return estuary::Fail("estuary-client", status); }

// What a site's data directory holds: IDX files (images) or text files in the
// fortunes format (documents between `%` lines). "auto" picks images when the
// IDX training files are there. Exactly one of the two is set.
using client::SiteData;

// Or a JSON Lines file of instruction examples (models/instruction_set.h):
// "auto" picks it for a file named *.jsonl, and it needs --template and
// --tokenizer.
struct InstructionFlags {
  std::string prompt_template, tokenizer;
};

Result<SiteData> LoadSiteData(const std::filesystem::path& dir, const std::string& kind,
                              const InstructionFlags& instruction) {
  if (kind != "auto" && kind != "images" && kind != "text" && kind != "instructions") {
    return InvalidArgument("--data-kind '{}': expected auto, images, text or instructions", kind);
  }
  std::error_code ec;
  if (kind == "instructions" || (kind == "auto" && dir.extension() == ".jsonl")) {
    if (instruction.prompt_template.empty() || instruction.tokenizer.empty()) {
      return InvalidArgument("--data {}: instruction data needs --template (llama3, chatml, alpaca, none) and "
                             "--tokenizer (the model's tokenizer.json)",
                             dir.string());
    }
    ESTUARY_ASSIGN_OR_RETURN(auto set, models::LoadInstructionSet(dir, instruction.tokenizer,
                                                                 instruction.prompt_template));
    spdlog::info("{}: {} examples under the {} template, {} scored tokens", dir.string(), set.examples.size(),
                 set.template_name(), set.scored_tokens);
    SiteData data;
    data.instructions = std::make_shared<const models::InstructionSet>(std::move(set));
    return data;
  }
  if (!instruction.prompt_template.empty() || !instruction.tokenizer.empty()) {
    return InvalidArgument("--template and --tokenizer are for instruction data (--data FILE.jsonl); {} is not",
                           dir.string());
  }
  const bool has_idx = std::filesystem::exists(dir / "train-images-idx3-ubyte", ec);
  SiteData data;
  if (kind == "text" || (kind == "auto" && !has_idx && std::filesystem::is_directory(dir, ec))) {
    ESTUARY_ASSIGN_OR_RETURN(auto sources, models::LoadFortunes(dir, {}));
    auto tokens = std::make_shared<std::vector<int32_t>>();
    for (const auto& source : sources) {  // all of the site's text trains
      tokens->insert(tokens->end(), source.train.begin(), source.train.end());
      tokens->insert(tokens->end(), source.test.begin(), source.test.end());
    }
    spdlog::info("{}: {} text files, {} tokens", dir.string(), sources.size(), tokens->size());
    data.text = std::move(tokens);
    return data;
  }
  ESTUARY_ASSIGN_OR_RETURN(auto dataset, models::LoadIdx(dir, models::Split::kTrain));
  data.images = std::make_shared<const models::Dataset>(std::move(dataset));
  return data;
}

// What a site brings to lora federations: its own adapter rank (0: the
// federation's) and how it keeps the frozen base.
struct LoraSite {
  int rank = 0;
  DType base = DType::kF32;
};

Result<int> GpuCount() {
#ifdef ESTUARY_HAVE_NCCL
  ESTUARY_RETURN_IF_ERROR(models::cuda::CudaUsable());
  return models::cuda::CudaDeviceCount();
#else
  return FailedPrecondition("this build has no NCCL (CUDA and NCCL were not found when it was configured)");
#endif
}

// A rank's communicator and, for an NCCL rank, its compute stream (a
// cudaStream_t): the rank's engine runs there and the communicator's
// collectives follow it, so a bucket's all-reduce starts when the backward
// kernels before it are done. The stream lives as long as the process.
struct RankLink {
  std::unique_ptr<comm::Communicator> comm;
  void* stream = nullptr;
};

// served: rank 0's store when it already serves (a single node's default).
Result<RankLink> ConnectRanks(const client::SiteLayout& site, std::unique_ptr<comm::Store> served) {
  comm::RendezvousOptions options{site.rendezvous, site.global_rank(), site.world(), site.timeout};
  if (site.backend == "gloo") {
    ESTUARY_ASSIGN_OR_RETURN(auto comm, comm::ConnectGloo(options, {}, std::move(served)));
    return RankLink{std::move(comm)};
  }
#ifdef ESTUARY_HAVE_NCCL
  const int gpu = site.gpus[site.local_rank];
  cudaStream_t stream = nullptr;
  if (cudaError_t e = cudaSetDevice(gpu); e != cudaSuccess) {
    return FailedPrecondition("rank {}: cudaSetDevice({}) failed: {}", site.global_rank(), gpu, cudaGetErrorString(e));
  }
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    return FailedPrecondition("rank {}: cudaStreamCreate on GPU {} failed: {}", site.global_rank(), gpu,
                              cudaGetErrorString(e));
  }
  ESTUARY_ASSIGN_OR_RETURN(auto comm, comm::ConnectNccl(options, gpu, stream, std::move(served)));
  return RankLink{std::move(comm), stream};
#else
  return FailedPrecondition("--backend nccl: this build has no NCCL");
#endif
}

Result<std::unique_ptr<client::RankTrainer>> MakeRankTrainer(const RankLink& link, const SiteData& data,
                                                             const client::SiteLayout& site,
                                                             const client::Compute& compute, const LoraSite& lora,
                                                             bool recompute) {
  comm::Communicator& comm = *link.comm;
  parallel::DataParallelOptions options;
  options.stage = site.zero;
  client::RankModels models;
  ESTUARY_RETURN_IF_ERROR(client::CheckStageOn(compute, site.zero));
  if (compute.device == Device::kCuda) models = client::CudaModels(compute, link.stream);
  models.lora_rank = lora.rank;
  models.lora_base = lora.base;
  models.recompute = recompute;
  if (data.instructions) return client::MakeInstructionRankTrainer(comm, data.instructions, options, std::move(models));
  if (data.text) return client::MakeTextRankTrainer(comm, data.text, options, std::move(models));
  return client::MakeClassifierRankTrainer(comm, data.images, data.indices, options, std::move(models));
}

// Local rank 0's children: started with the same arguments, reaped here.
class LocalRanks {
 public:
  // Starts local ranks 1..N-1; args are this process's, extra is appended.
  Status Start(const client::SiteLayout& site, int argc, char** argv, const std::vector<std::string>& extra) {
    for (int r = 1; r < site.local_ranks; ++r) {
      std::vector<std::string> args(argv, argv + argc);
      args.insert(args.end(), extra.begin(), extra.end());
      args.insert(args.end(), {"--local-rank", std::to_string(r)});
      ESTUARY_ASSIGN_OR_RETURN(const pid_t pid, client::SpawnRank(args));
      running_[pid] = site.node_rank * site.local_ranks + r;
    }
    return Status::Ok();
  }
  // Reaps the children that have ended; an error naming one that ended badly.
  Status Poll() {
    Reap(WNOHANG);
    return Cause();
  }
  // When this rank failed: which local rank (if any) ended first and why,
  // waiting up to `grace` for it to be reapable (a killed rank's sockets
  // close, failing our collective, a moment before the kernel reports its death).
  Status CauseOfFailure(std::chrono::milliseconds grace) {
    const auto deadline = std::chrono::steady_clock::now() + grace;
    while (Cause().ok() && !running_.empty() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      Reap(WNOHANG);
    }
    return Cause();
  }
  // Waits for every child (killing them first when `kill`); an error naming
  // one that ended badly on its own.
  Status WaitAll(bool kill) {
    Reap(WNOHANG);
    const Status cause = Cause();
    if (kill) {
      for (const auto& [pid, rank] : running_) ::kill(pid, SIGKILL);
    }
    Reap(0);
    return kill ? cause : Cause();
  }

 private:
  struct Ended {
    pid_t pid;
    int rank;
    int status;
  };
  void Reap(int flags) {
    for (auto it = running_.begin(); it != running_.end();) {
      int status = 0;
      const pid_t got = waitpid(it->first, &status, flags);
      if (got == 0) {
        ++it;
        continue;
      }
      if (got == it->first) ended_.push_back({it->first, it->second, status});
      it = running_.erase(it);
    }
  }
  // A rank killed by a signal is the likeliest root cause; ranks that exited
  // with an error usually saw it fail a collective.
  Status Cause() const {
    const Ended* worst = nullptr;
    for (const Ended& e : ended_) {
      if (WIFEXITED(e.status) && WEXITSTATUS(e.status) == 0) continue;
      if (!worst || (WIFSIGNALED(e.status) && !WIFSIGNALED(worst->status))) worst = &e;
    }
    if (!worst) return Status::Ok();
    return Aborted("site rank {} (pid {}) {}", worst->rank, worst->pid, client::DescribeWaitStatus(worst->status));
  }

  std::map<pid_t, int> running_;  // pid -> global rank
  std::vector<Ended> ended_;
};

// SCAFFOLD's c_i: in `state_dir` (created) when one is given, so a
// restarted site goes on from its last round; else in memory.
Result<std::shared_ptr<client::SiteControl>> OpenSiteControl(const std::string& state_dir) {
  if (state_dir.empty()) return std::make_shared<client::SiteControl>();
  std::error_code ec;
  std::filesystem::create_directories(state_dir, ec);
  if (ec) return IoError("--state-dir {}: {}", state_dir, ec.message());
  ESTUARY_ASSIGN_OR_RETURN(client::SiteControl control,
                           client::SiteControl::Open(std::filesystem::path(state_dir) / "scaffold-control.f32"));
  if (!control.value().empty()) {
    spdlog::info("SCAFFOLD: this site's control variate c_i ({} values) from {}", control.value().size(), state_dir);
  }
  return std::make_shared<client::SiteControl>(std::move(control));
}

// Runs the Agent until the federation completes or the site gives up. With
// a site (rank 0 of several), it also keeps the followers told that rank 0 is
// alive between rounds, tells them when it is over, and gives up the
// connection as soon as a local rank ends badly or a collective fails.
Status RunAgent(const client::AgentOptions& options, client::Trainer& trainer, client::SiteTrainer* site,
                LocalRanks* children, std::chrono::milliseconds rank_timeout, uint64_t* rounds_trained) {
  namespace asio = boost::asio;
  asio::io_context io;
  asio::thread_pool training(1);  // site: the one thread that uses the communicator
  auto agent = std::make_shared<client::Agent>(io, options, trainer, training.get_executor());
  Status outcome;
  bool done = false;
  agent->on_round_closed = [&](const v1::RoundClosed& closed) {
    spdlog::info("round {} {}: {} updates{}", closed.round(), closed.committed() ? "committed" : "failed",
                 closed.updates_received(),
                 closed.has_test_metrics() ? fmt::format(", test accuracy {:.4f}", closed.test_accuracy()) : "");
  };
  asio::signal_set signals(io, SIGINT, SIGTERM);
  asio::signal_set child_signals(io);
  asio::steady_timer keepalive(io);
  agent->on_finished = [&](const Status& status) {
    outcome = status;
    done = true;
    signals.cancel();
    child_signals.cancel();
    keepalive.cancel();
  };
  signals.async_wait([&](const boost::system::error_code& ec, int) {
    if (!ec) {
      outcome = Aborted("interrupted");
      agent->Stop();
      child_signals.cancel();
      keepalive.cancel();
      done = true;
    }
  });
  std::function<void()> tick, watch;
  if (site) {
    // Weak: the site outlives this function, and the Agent must end with the
    // io_context its timers belong to (below), not with the site.
    site->on_broken = [&io, weak = std::weak_ptr<client::Agent>(agent)](const Status& s) {
      asio::post(io, [weak, s] {
        if (auto agent = weak.lock()) agent->Fail(s);
      });
    };
    // Well inside the followers' timeout, so a slow federation never reads as a dead rank 0.
    tick = [&] {
      keepalive.expires_after(rank_timeout / 3);
      keepalive.async_wait([&](const boost::system::error_code& ec) {
        if (ec || done) return;
        asio::post(training, [site] { (void)site->KeepAlive(); });  // a failure reaches on_broken
        tick();
      });
    };
    tick();
    child_signals.add(SIGCHLD);
    watch = [&] {
      child_signals.async_wait([&](const boost::system::error_code& ec, int) {
        if (ec || done) return;
        if (Status s = children->Poll(); !s.ok()) return agent->Fail(s);
        watch();
      });
    };
    watch();
  }
  agent->Start();
  io.run();
  if (site) {
    asio::post(training, [&] {
      if (Status s = site->Finish(outcome); !s.ok() && outcome.ok()) outcome = s;
    });
  }
  training.join();
  if (site) site->on_broken = nullptr;  // it names io, which ends here
  *rounds_trained = agent->rounds_trained();
  return outcome;
}

}  // namespace

int main(int argc, char** argv) {
  estuary::proto::QuietProtobufLog();
  using namespace estuary;
  RetainFreedMemory();
  CLI::App app{"estuary-client: a federated learning site"};
  ShowDefaultsInHelp(app);
  std::string server = "127.0.0.1:7443", config;
  crypto::TlsFiles tls;
  std::string data, data_kind = "auto", device = "cpu", precision = "fp32";
  double max_backoff = 30;
  std::string log_level = "info";
  int lora_rank = 0;
  std::string lora_base = "f32";
  std::string base_model;
  client::SiteFlags site_flags;
  double eval_split = 0.1;
  uint64_t eval_seed = 0;
  app.add_option("--config", config, "TOML file with the same keys as these flags");
  app.add_option("--server", server, "aggregation server HOST:PORT");
  app.add_option("--cert", tls.cert, "this site's certificate (PEM)");
  app.add_option("--key", tls.key, "this site's private key (PEM)");
  app.add_option("--ca", tls.ca, "the federation CA certificate (PEM)");
  app.add_option("--crl", tls.crl, "the CA's revocation list (PEM): refuse a server whose certificate it revokes");
  app.add_option("--data", data,
                 "this site's training data: a directory of IDX files or of text files, or a JSON Lines file of "
                 "instruction examples");
  app.add_option("--data-kind", data_kind, "auto | images | text | instructions (auto: a *.jsonl file is instructions)");
  InstructionFlags instruction;
  app.add_option("--template", instruction.prompt_template,
                 "instruction data: the prompt template, the federation's (llama3 | chatml | alpaca | none)");
  app.add_option("--tokenizer", instruction.tokenizer,
                 "instruction data: this site's tokenizer.json (its tokenizer_config.json beside it)");
  app.add_option("--eval-split", eval_split,
                 "fraction of this site's examples held out of training, on which it scores the global model when "
                 "the server asks (federated evaluation; 0: none, the site does not evaluate)");
  app.add_option("--eval-seed", eval_seed, "seed of which examples --eval-split holds out");
  app.add_option("--device", device, "where a site without --gpus trains: cpu | cuda | cuda:N");
  app.add_option("--precision", precision, "fp32 | bf16 | fp16 (bf16 and fp16 need a GPU)");
  double max_local_seconds = 0;
  app.add_option("--max-local-seconds", max_local_seconds,
                 "this site's cap on a round's local training time, in seconds: it stops after the step that "
                 "crosses it and reports the steps it took; the tighter of it and the server's applies (0: none)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-backoff", max_backoff, "longest wait between reconnection attempts, seconds");
  AddLogLevelFlag(app, &log_level);
  app.add_option("--lora-rank", lora_rank,
                 "lora federations that take mixed ranks: this site's adapter rank (0: the federation's)");
  app.add_option("--lora-base-dtype", lora_base,
                 "lora federations: keep the frozen base in f32 | bf16 (CPU: half the memory, trains on the "
                 "bf16-rounded base)");
  bool recompute = false;
  app.add_flag("--recompute", recompute,
               "language models: keep each block's input only and recompute its activations in backward (one "
               "block's activations in memory, about one more forward per step; CPU and GPU)");
  int blas_threads = 1;
  std::string secagg_keep_input;
  app.add_option("--secagg-keep-input", secagg_keep_input,
                 "a server running --secagg: keep a copy of the quantised input this site masked each round, in DIR "
                 "(round-R.site-U.w-W.u32, little-endian ring elements): the site's own record of what it contributed");
  std::string state_dir;
  app.add_option("--state-dir", state_dir,
                 "where the site keeps what outlives a restart: SCAFFOLD's control variate c_i "
                 "(scaffold-control.f32, replaced atomically each round; without it c_i lives in memory only)");
  app.add_option("--base-model", base_model,
                 "this site's copy of the federation's Hugging Face base (a model directory); the server never "
                 "sends it, and a round whose base differs from it is refused");
  app.add_option("--blas-threads", blas_threads, "OpenBLAS threads for local training (small batches: 1 is fastest)");
  app.add_option("--ranks", site_flags.ranks, "train on N CPU processes (ranks) of this node");
  app.add_option("--backend", site_flags.backend, "collectives among the ranks: gloo (CPU) | nccl (--gpus)");
  app.add_option("--gpus", site_flags.gpus, "train one rank per GPU: all | 0,1,...");
  app.add_option("--zero", site_flags.zero, "0: DDP; 1, 2, 3: ZeRO stage");
  app.add_option("--nodes", site_flags.nodes, "nodes of this site");
  app.add_option("--node-rank", site_flags.node_rank, "this node's index among --nodes");
  app.add_option("--rendezvous", site_flags.rendezvous,
                 "where the ranks meet: tcp://HOST:PORT (node 0) | file:///DIR; default: a free port on 127.0.0.1");
  app.add_option("--rank-timeout", site_flags.rank_timeout_s, "seconds a rank waits for the others before the site fails");
  app.add_option("--local-rank", site_flags.local_rank, "internal: set by the launcher for the ranks it starts")
      ->group("");
  if (auto exit = ParseCommandLine(app, argc, argv, "estuary-client")) return *exit;
  if (!config.empty()) {
    if (Status s = ApplyConfigFile(app, config); !s.ok()) return Fail(s);
  }
  if (blas_threads < 1) return Fail(InvalidArgument("--blas-threads {}: must be >= 1", blas_threads));
  openblas_set_num_threads(blas_threads);
  LoraSite lora{lora_rank};
  if (auto dtype = ParseDType(lora_base); dtype.ok() && *dtype != DType::kF16) {
    lora.base = *dtype;
  } else {
    return Fail(InvalidArgument("--lora-base-dtype '{}': expected f32 or bf16", lora_base));
  }
  auto site = client::MakeSiteLayout(site_flags, GpuCount);
  if (!site.ok()) return Fail(site.status());
  const bool agent_rank = site->global_rank() == 0;
  StartLogging(site->multi_rank() ? fmt::format("estuary-client rank {}", site->global_rank()) : "estuary-client",
               log_level);
  if (data.empty() || (agent_rank && (tls.cert.empty() || tls.key.empty() || tls.ca.empty()))) {
    return Fail(InvalidArgument("--cert, --key, --ca and --data are required"));
  }
  std::string host;
  uint16_t port = 0;
  if (Status s = ParseHostPort(server, &host, &port); !s.ok()) return Fail(InvalidArgument("--server: {}", s.message()));

  // GPU ranks take their device from --gpus; a site without --gpus from --device.
  if (!site->gpus.empty() && app.get_option("--device")->count() > 0) {
    return Fail(InvalidArgument("--device {} with --gpus {}: the GPUs are --gpus's", device, site_flags.gpus));
  }
  auto compute = client::ParseCompute(
      site->gpus.empty() ? device : fmt::format("cuda:{}", site->gpus[site->local_rank]), precision);
  if (!compute.ok()) return Fail(compute.status());
  if (site->multi_rank() && site->backend == "gloo" && compute->device != Device::kCpu) {
    return Fail(InvalidArgument("--device {} with {} ranks: gloo ranks train on the CPU; use --gpus for GPUs", device,
                                site->world()));
  }
  auto site_data = LoadSiteData(data, data_kind, instruction);
  if (!site_data.ok()) return Fail(site_data.status());
  // Before any rank is built: every rank trains on the same examples.
  auto held_out = client::SplitHeldOut(&*site_data, eval_split, MixSeed(eval_seed, std::string_view("held-out")));
  if (!held_out.ok()) return Fail(held_out.status());
  if (held_out->examples() > 0) {
    spdlog::info("{} {} held out of training for federated evaluation (--eval-split {:g})", held_out->examples(),
                 held_out->images ? "examples" : "tokens", eval_split);
  }
  client::AgentOptions options;
  options.host = host;
  options.port = port;
  options.max_backoff_s = max_backoff;
  options.label = tls.cert.stem().string();
  options.secagg_keep_dir = secagg_keep_input;
  if (agent_rank) {
    auto control = OpenSiteControl(state_dir);
    if (!control.ok()) return Fail(control.status());
    options.scaffold = std::move(control).value();
  }
  if (agent_rank && !base_model.empty()) {
    auto base = models::LoadHfBase(base_model, {.recompute = recompute});
    if (!base.ok()) return Fail(InvalidArgument("--base-model {}: {}", base_model, base.status().message()));
    spdlog::info("base model {}: {} ({} parameters), sha256 {}", base_model, base->ModelName(), base->weights.size(),
                 base->sha256);
    options.base = std::make_shared<const models::HfBase>(std::move(base).value());
  }
  if (agent_rank) {
    auto context = crypto::MakeClientContext(tls);
    if (!context.ok()) return Fail(context.status());
    options.tls = *context;
  }

  if (!site->multi_rank() && site_flags.backend.empty()) {
    // One rank and no collectives asked for: the rank trains over a solo
    // communicator. (A --backend given runs even one rank over it: how one
    // GPU exercises NCCL.)
    auto trainer = client::MakeLocalSite(*site_data, {.compute = *compute,
                                                      .stage = site->zero,
                                                      .lora_rank = lora.rank,
                                                      .lora_base = lora.base,
                                                      .recompute = recompute});
    if (!trainer.ok()) return Fail(trainer.status());
    (*trainer)->set_max_local_seconds(max_local_seconds);
    spdlog::info("site of 1 rank on {} ({}, solo{})", compute->ToString(), parallel::ZeroStageName(site->zero),
                 recompute ? ", activation recompute" : "");
    uint64_t rounds = 0;
    client::EvaluatingTrainer evaluating(**trainer, *held_out);
    Status outcome = RunAgent(options, evaluating, nullptr, nullptr, site->timeout, &rounds);
    if (!outcome.ok()) return Fail(outcome);
    spdlog::info("federation complete; trained {} rounds", rounds);
    return 0;
  }

  // A site of several ranks. Local rank 0 starts the others of its node.
  LocalRanks children;
  std::unique_ptr<comm::Store> served;
  if (site->local_rank == 0) {
    std::vector<std::string> extra;
    if (site->rendezvous.empty()) {
      // Serving before the others start: they are told a port already held.
      auto store = comm::ServeLoopbackStore();
      if (!store.ok()) return Fail(store.status());
      served = std::move(store).value();
      site->rendezvous = served->address();
      extra = {"--rendezvous", site->rendezvous};
    }
    if (Status s = children.Start(*site, argc, argv, extra); !s.ok()) {
      (void)children.WaitAll(true);
      return Fail(s);
    }
  }
  // Every exit from here reaps the children first: killed when this rank failed.
  auto fail = [&](const Status& s) {
    if (Status cause = children.CauseOfFailure(std::chrono::seconds(1)); !cause.ok()) {
      (void)children.WaitAll(true);
      if (cause.message() == s.message()) return Fail(s);
      return Fail(Aborted("{} (rank {}: {})", cause.message(), site->global_rank(), s.message()));
    }
    (void)children.WaitAll(true);
    return Fail(s);
  };
  auto link = ConnectRanks(*site, std::move(served));
  if (!link.ok()) return fail(link.status());
  comm::Communicator& comm = *link->comm;
  auto rank_trainer = MakeRankTrainer(*link, *site_data, *site, *compute, lora, recompute);
  if (!rank_trainer.ok()) return fail(rank_trainer.status());
  spdlog::info("rank {} of {} (pid {}, {}, {}{}) joined at {}", site->global_rank(), site->world(), getpid(),
               site->backend, site->zero == parallel::ZeroStage::kDdp ? "DDP" : fmt::format("ZeRO-{}", int(site->zero)),
               recompute ? ", activation recompute" : "", site->rendezvous);

  if (!agent_rank) {
    if (Status s = client::RunFollower(comm, **rank_trainer); !s.ok()) return fail(s);
    if (Status s = children.WaitAll(false); !s.ok()) return Fail(s);
    return 0;
  }
  client::SiteTrainer trainer(comm, std::move(*rank_trainer), site->zero, *compute);
  trainer.set_max_local_seconds(max_local_seconds);
  uint64_t rounds = 0;
  client::EvaluatingTrainer evaluating(trainer, *held_out);  // on rank 0 alone
  Status outcome = RunAgent(options, evaluating, &trainer, &children, site->timeout, &rounds);
  if (!outcome.ok()) return fail(outcome);
  if (Status s = children.WaitAll(false); !s.ok()) return Fail(s);
  spdlog::info("federation complete; trained {} rounds on {} ranks", rounds, site->world());
  return 0;
}
