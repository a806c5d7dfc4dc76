// ServerConfig: everything `estuary-server serve` is told, from flags or a
// TOML file with the same keys (see README).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include "aggregation/federation.h"
#include "base/host_port.h"
#include "crypto/tls.h"
#include "estuary.pb.h"
#include "proto/frame.h"

namespace estuary::server {

struct ServerConfig {
  std::string listen = "127.0.0.1:7443";  // HOST:PORT; port 0 picks a free one
  std::string metrics_listen;             // HOST:PORT of the Prometheus endpoint; empty: none
  std::filesystem::path tensorboard;      // TensorBoard event files for the committed rounds; empty: none
  crypto::TlsFiles tls;
  std::filesystem::path db = "estuary.db";
  std::filesystem::path checkpoint_dir;     // default: "<db>.checkpoints"
  std::filesystem::path eval_data;          // IDX dir, fortunes dir, or instruction JSONL; empty = no evaluation
  std::filesystem::path tokenizer;          // an instruction eval_data's; empty: the Hugging Face base's

  // sync: the rounds above. async: FedBuff (aggregation/fedbuff.h,
  // server/async_coordinator.h): no round barrier, every `buffer` accepted
  // updates make a new model version, weighted by their staleness; `rounds`
  // counts the versions committed. CheckAsync says what it cannot run with.
  std::string mode = "sync";
  uint64_t rounds = 20;
  struct Async {
    uint32_t buffer = 10;       // K: accepted updates folded into one version
    uint32_t concurrency = 0;   // C: sites training at once; 0: every connected site
    std::string staleness_weight = "constant";  // constant | poly:A | hinge:A,B
    int64_t max_staleness = -1;  // S: an update more versions stale is refused; -1: none is
  };  // η_g is the federation's server_lr (1 when unset), as in estuary-sim --async
  Async async;
  double clients_per_round = 10;   // >= 1: a count; in (0, 1): a fraction of those connected
  uint32_t min_clients = 10;       // connected clients needed before a round starts
  uint32_t min_updates = 1;        // updates needed to aggregate at the deadline
  double round_deadline_s = 600;
  // Federated evaluation (docs/EVALUATION.md): after every evaluate_every-th
  // committed round, and after the last, sites score the new global model on
  // their own held-out examples (an evaluation round of its own, before the
  // next training round); 0: never. evaluate_clients: sites asked, a count
  // (>= 1) or a fraction (< 1) of the connected sites that evaluate; 0: all.
  uint64_t evaluate_every = 0;
  double evaluate_clients = 0;
  // The task every selected client trains, the strategy, the seed, the base
  // model: checked by aggregation::CheckFederation, built by MakeFederation.
  v1::FederationConfig federation = aggregation::DefaultFederation();

  uint64_t max_frame_bytes = proto::kDefaultMaxFrameBytes;
  uint32_t chunk_bytes = proto::kDefaultChunkBytes;
  uint32_t staging_slots = 4;                  // uploads staged at once
  uint64_t staging_memory_bytes = 256u << 20;  // per upload; beyond it, a temp file
  std::filesystem::path spill_dir;             // default: checkpoint_dir
  double handshake_timeout_s = 10;
  double idle_timeout_s = 60;                  // no frame for this long: the peer is gone
  double write_timeout_s = 30;                 // a frame not written for this long: the peer does not read
  // A model download holds one of the concurrent download places this long
  // at most; then the next starts beside it (ModelDistribution).
  double download_slot_timeout_s = 30;
  // Limits on what connections may cost before they are sites (Acceptor):
  // connections between accept and their Hello, at once, and from one
  // peer address; one beyond either is closed at once.
  uint32_t max_handshakes = 512;
  uint32_t max_handshakes_per_address = 128;
  // Frames being received and model chunks being sent, all sessions
  // together (BufferBudget).
  uint64_t frame_memory_bytes = 256u << 20;
  uint32_t io_threads = 4;                     // run the sessions; the round logic keeps its own strand
  double event_interval_s = 10;                // repeated events from one address: a summary per interval
  uint64_t heartbeat_ms = 5000;
  bool exit_when_done = false;                 // stop serving after the last round

  // SecAgg+ (docs/SECAGG.md): each round's FedAvg sum goes through the
  // protocol over the sites' sessions; the server sees only the sum.
  // neighbours / threshold 0: secagg::DefaultDegree(n) / DefaultThreshold(k).
  struct SecAgg {
    bool on = false;
    int neighbours = 0;
    int threshold = 0;
    int bits = 32;      // the ring Z/2^bits
    double clip = 100;  // C: the L2 norm a site clips its update to
  };
  SecAgg secagg;

  // Differential privacy beside the federation's dp settings (docs/PRIVACY.md).
  // central: DP-FedAvg clips and noises on the server. distributed (needs
  // secagg): each site clips its update to dp_clip and adds its share of
  // discrete Gaussian noise before masking; the server unmasks no sum of
  // fewer than ⌈dp_survivors · sites⌉ inputs. CheckDp says what is refused.
  std::string dp_mode = "central";
  double dp_survivors = 1;
  // Poisson sampling: each connected site joins each round with probability
  // sample_rate, instead of clients_per_round (0: off). The draws come from
  // RAND_bytes, or, with sample_seed != 0, from that seed (tests).
  double sample_rate = 0;
  uint64_t sample_seed = 0;
  // Whether distributed DP is on: secagg with dp_mode distributed.
  bool distributed_dp() const { return dp_mode == "distributed"; }

  // Fills defaults that depend on other fields and checks ranges; errors
  // name the key ("config: clients_per_round = 0: must be > 0").
  Status Finalize();
  // The secagg settings, and what they cannot be combined with (one line each).
  Status CheckSecAgg() const;
  // dp_mode, dp_survivors and sample_rate, and what they cannot be combined
  // with (one line each).
  Status CheckDp() const;
  // mode = async's settings, and what asynchronous rounds cannot be combined
  // with (one line each, saying why).
  Status CheckAsync() const;
};

}  // namespace estuary::server
