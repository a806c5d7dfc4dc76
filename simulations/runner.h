// The many-client simulation: one scenario, run in process or over loopback.
//
// inproc:   every client trains in this process, `threads` at a time; updates
//           are folded in the sorted order of the clients' names, so a run is
//           bit-for-bit reproducible from its seed.
// loopback: a real estuary-server (a child process, or --server to attach)
//           and one real mutual-TLS connection per client, all in this
//           process; the server folds in arrival order.
// Both modes sample the same clients per round (aggregation::SampleClients,
// or under --sample-rate the seeded Poisson draw) and start from the same
// initial model, so they agree to rounding. Noise never agrees: the server's
// DP-FedAvg noise and a loopback site's distributed-DP share and stochastic
// rounding come from RAND_bytes, the in-process ones from the seed.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "aggregation/federation.h"
#include "base/status.h"
#include "client/trainer.h"
#include "simulations/report.h"
#include "simulations/secagg_round.h"

namespace estuary::simulations {

struct Scenario {
  // The federation: task, strategy, seed, base model (the server's flags).
  v1::FederationConfig federation = aggregation::DefaultFederation();
  v1::TaskConfig& task() { return *federation.mutable_task(); }
  const v1::TaskConfig& task() const { return federation.task(); }

  uint32_t clients = 100;
  double per_round = 10;        // count (>= 1) or fraction (< 1)
  // > 0: Poisson sampling instead — each client joins a round independently
  // with this probability (poisson_sampling.h), and the accountant uses it as q;
  // DP-FedAvg and distributed DP divide by the expected q · clients.
  double sample_rate = 0;
  uint64_t rounds = 20;
  std::string partition = "iid";      // images: iid | shards | dirichlet:ALPHA; text: topic
  // Images: > 0 makes each site draw this many examples of its own (sites
  // sharing examples), made only when sampled (population.h), so `clients`
  // may be millions; 0 splits the training set among the clients.
  uint32_t examples_per_client = 0;
  std::string topics;                 // text: comma-separated topics the clients hold (empty: the first `clients`)
  std::string device = "cpu";         // where the clients train: cpu | cuda | cuda:N
  std::string precision = "fp32";     // fp32 | bf16 | fp16 (cuda only)
  // lora, exact only: the sites' own ranks, comma-separated, client i taking
  // entry i mod n (e.g. "4,8,16"); empty: every site trains the federation's.
  // Given, it makes the federation take mixed ranks.
  std::string lora_site_ranks;
  std::string lora_base_dtype = "f32";  // how the sites keep the frozen base: f32 | bf16 (the CPU's, half the memory)
  bool recompute = false;  // the sites' decoders recompute activations in backward (CPU and GPU)
  std::string mode = "inproc";
  std::filesystem::path data_dir = "data/mnist";  // text models: a fortunes directory, or a *.jsonl file
  // Instruction data (data_dir a JSON Lines file; simulations/instruction_sites.h):
  // the sites' tokenizer, and how the file is split among them. With
  // partition_by, clients 0 means one site per distinct value.
  std::filesystem::path tokenizer;
  std::string partition_by;
  double dirichlet_alpha = 0;
  std::string label_field;
  // inproc, full updates: a fraction `attackers` of the sites is malicious
  // and uploads what `attack` says (attack.h: sign-flip[:L] | scale:L |
  // gaussian:S | nan). Empty: none.
  std::string attack;
  double attackers = 0;
  // Image federations: a fraction `stragglers` of the sites runs only part of
  // its local steps each round, a share drawn from straggler_work "MIN:MAX"
  // (stragglers.h). Both modes.
  double stragglers = 0;
  std::string straggler_work = "0.1:0.5";
  // Each round's mean through SecAgg+ (secagg_round.h): inproc in-process,
  // loopback by the server over the sites' sessions.
  bool secagg = false;
  SecAggOptions secagg_options;  // its dp.survivors is --dp-survivors; its dropout and the rest of dp are the runner's
  // A fraction of each round's sampled sites drops out, each at a stage drawn
  // from the seed (dropout_draw.h): after training or mid-upload, or under
  // --secagg at one of the protocol's four stages. Inproc leaves their
  // updates out; in loopback their agents close their connections to the
  // server there (loopback_dropout.h). In [0, 1).
  double dropout = 0;
  // Loopback under --secagg: where every site keeps the quantised input it
  // masked (client::AgentOptions::secagg_keep_dir); empty: nowhere.
  std::filesystem::path secagg_keep_dir;
  // How the federation's DP noise (federation.dp, on when its noise multiplier
  // is > 0) is added: "central" — DP-FedAvg on the server
  // (aggregation/dp_fedavg.h) — or "distributed": each site adds its share of
  // discrete Gaussian noise inside --secagg (secagg_round.h).
  std::string dp = "central";
  uint32_t threads = 2;
  // --async (async_runner.h): FedBuff's asynchronous rounds, inproc only;
  // `rounds` counts model versions, made every `buffer` (K) arrivals from
  // `concurrency` (C) sites training at once, each update discounted by
  // `staleness_weight` (constant | poly:A | hinge:A,B) and refused beyond
  // `max_staleness` versions (-1: none). The server lr is the federation's
  // (1 where it is unset).
  bool async = false;
  uint32_t buffer = 10;
  uint32_t concurrency = 10;
  std::string staleness_weight = "constant";
  int64_t max_staleness = -1;
  // Federated evaluation (docs/EVALUATION.md), both modes: after every
  // evaluate_every-th round and the last, the sampled sites (evaluate_clients:
  // a count, a fraction, 0: all) score the global model on eval_split of their
  // own examples, held out of their training. 0: never (nothing held out).
  uint64_t evaluate_every = 0;
  double evaluate_clients = 0;
  double eval_split = 0.1;
  // loopback only
  std::string server;                        // attach to HOST:PORT instead of starting one
  std::filesystem::path round_log;           // with `server`: its SQLite file, for the report
  std::filesystem::path workdir = "run/sim";  // certificates, round log, checkpoints
  std::filesystem::path server_binary;       // default: estuary-server beside this program
};

nlohmann::json ScenarioJson(const Scenario& scenario);

// The federation the scenario runs: its config, with mixed ranks when the
// sites have their own (lora_site_ranks).
v1::FederationConfig FederationOf(const Scenario& scenario);

// Called after every round, on the thread that runs the simulation.
using RoundCallback = std::function<void(const RoundReport&, uint64_t rounds_total)>;

class SimRanks;

// With final_global, the global model after the last round is written there
// (for a lora federation: base, then adapter; models/lora_federation.h).
// With ranks (under mpirun, rank 0; sim_ranks.h), each round's sites are
// trained across the ranks and folded here in the same order: the same run.
Result<Report> RunInproc(const Scenario& scenario, const RoundCallback& on_round,
                         std::vector<float>* final_global = nullptr, SimRanks* ranks = nullptr);
Result<Report> RunLoopback(const Scenario& scenario, const RoundCallback& on_round);

}  // namespace estuary::simulations
