// Store: the server's durable record, in SQLite (WAL mode).
//
// Tables: clients (registry), rounds (one row per round, its state and
// aggregate metrics), participations (one row per client per round),
// transitions (every state change of every round), checkpoints (index of the
// model files), events (refused handshakes, rejected frames), round_privacy
// (a DP round's release and the ε spent after it), round_secagg (a SecAgg+
// round's stages), round_evaluation (the federated evaluation of a committed
// round's model), round_arrivals (asynchronous rounds: every update that
// arrived while a version was built) and meta. A round log of schema 1
// (before round_privacy), 2 (before round_secagg), 3 (before
// round_evaluation), 4 (before the consistency check's columns) or 5
// (before round_arrivals) is migrated when a server opens it, and read as it
// is by the operator CLI.
// A round's final record, its checkpoint row and its last transition are
// written in one transaction, so a restart sees a round committed or not at
// all. Every method is safe to call from one thread at a time.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

struct sqlite3;

namespace estuary::server {

// open -> collecting -> aggregating -> committed | failed
enum class RoundState { kOpen, kCollecting, kAggregating, kCommitted, kFailed };
const char* RoundStateName(RoundState state);  // "open", "collecting", ...

// What a DP-FedAvg round released (aggregation/dp_fedavg.h) and the privacy
// spent once it committed (privacy/accountant.h).
struct RoundPrivacy {
  double sampling_rate = 0;     // q = sites sampled / sites it was sampled from
  double noise_multiplier = 0;  // z, the accountant's
  double clip = 0;              // C the updates were clipped to
  double noise_stddev = 0;      // per coordinate of the sum
  double epsilon = 0;           // ε after this round, at delta
  double delta = 0;
};

// A round run through SecAgg+ (docs/SECAGG.md): how far the protocol got,
// and per stage (advertise keys, share keys, masked input, consistency check,
// unmasking) the
// sites that answered, those that dropped out while it was waiting for them,
// and the bytes moved (all sites together, as framed on the wire).
struct RoundSecAgg {
  static constexpr int kStageCount = 5;
  static constexpr const char* kStages[kStageCount] = {"advertise keys", "share keys", "masked input",
                                                       "consistency check", "unmasking"};
  std::string stage;          // the last stage begun: one of kStages, or "done" once the sum was unmasked
  uint32_t sites = 0;         // n
  uint32_t neighbours = 0;    // k
  uint32_t threshold = 0;     // t
  uint32_t bits = 0;
  double clip = 0;
  double scale = 0;
  std::array<uint32_t, kStageCount> answered{};
  std::array<uint32_t, kStageCount> dropouts{};
  std::array<uint64_t, kStageCount> bytes_up{};
  std::array<uint64_t, kStageCount> bytes_down{};
};

// The federated evaluation of a committed round's model (docs/EVALUATION.md):
// the sites asked scored it on their own held-out examples. Sites that do not
// evaluate, and those that failed or did not answer in time, are counted
// apart and weigh nothing. loss and accuracy are example-weighted means over
// the sites that reported (accuracy over those whose model has one).
struct RoundEvaluation {
  uint32_t selected = 0;
  uint32_t reported = 0;
  uint32_t unsupported = 0;
  uint32_t failed = 0;
  uint64_t examples = 0;
  double loss = 0;
  std::optional<double> accuracy;
  uint64_t accuracy_examples = 0;
  double seconds = 0;  // from the first request sent to the last answer (or the deadline)
};

struct RoundRecord {
  uint64_t round = 0;
  RoundState state = RoundState::kOpen;
  int64_t started_ms = 0;   // unix milliseconds
  int64_t ended_ms = 0;     // 0 while the round runs
  uint64_t model_version = 0;        // version after this round commits
  std::string global_checksum;       // sha256 hex of the model after this round
  std::string strategy;
  uint32_t clients_selected = 0;
  uint32_t updates_received = 0;
  double train_loss = 0;             // example-weighted mean of participants' losses
  std::optional<double> test_accuracy;  // when the server evaluates
  std::optional<double> test_loss;
  uint64_t bytes_up = 0;             // client -> server, update payloads
  uint64_t bytes_down = 0;           // server -> client, model payloads
  std::string detail;                // why a round failed
  std::optional<RoundPrivacy> privacy;  // a committed round of a DP federation
  std::optional<RoundSecAgg> secagg;    // a round summed by SecAgg+ (committed or failed); none: plain
  std::optional<RoundEvaluation> evaluation;  // a committed round the sites evaluated
};

// status: "selected", "committed", "dropped", "late", "rejected", "refused"
// (the site declined the round: its base model is not the federation's),
// "failed" (the site's training failed this round, and it said why).
// A site "dropped" in a plain round (no SecAgg+) has detail "connection lost"
// when it had begun no upload, and one beginning kLostMidUpload when it had
// (what had arrived was discarded).
inline constexpr std::string_view kLostMidUpload = "connection lost mid-upload";
struct Participation {
  uint64_t round = 0;
  std::string client;
  std::string status = "selected";
  uint64_t examples = 0;
  double train_loss = 0;
  uint64_t bytes_up = 0;
  uint64_t bytes_down = 0;
  double seconds = 0;                // from RoundStart sent to update committed
  std::string detail;
};

// Asynchronous rounds (FedBuff): one update that arrived while version
// `round` was built, in arrival order (`seq`, from 1). status: "folded"
// (weighted by `weight` = s(staleness)), "stale" (beyond max_staleness:
// refused, weight 0), "rejected" (the federation's limits or a bad value
// refused it). staleness = the version the server was at minus trained_from.
// A site may arrive more than once in one version.
struct Arrival {
  uint64_t round = 0;
  uint64_t seq = 0;
  std::string client;
  std::string status = "folded";
  uint64_t trained_from = 0;
  uint64_t staleness = 0;
  double weight = 0;
  uint64_t examples = 0;
  double train_loss = 0;
  uint64_t bytes_up = 0;
  double seconds = 0;  // from its RoundStart sent to its update committed
  int64_t at_ms = 0;
  std::string detail;
};

struct ClientRecord {
  std::string name;
  int64_t first_seen_ms = 0;
  int64_t last_seen_ms = 0;
  std::string last_address;          // "127.0.0.1:53412"
  uint64_t rounds_joined = 0;        // participations committed, and asynchronous arrivals folded
  uint64_t rounds_dropped = 0;       // participations dropped or late; arrivals stale or rejected
};

struct Transition {
  uint64_t round = 0;
  RoundState from = RoundState::kOpen;
  RoundState to = RoundState::kOpen;
  int64_t at_ms = 0;
  std::string detail;
};

struct Event {
  int64_t at_ms = 0;
  std::string kind;   // "handshake_refused", "frame_rejected", ...
  std::string peer;   // address, and name when known
  std::string detail;
};

class Store {
 public:
  // Opens or creates the database at `path` (WAL, foreign keys on).
  static Result<std::unique_ptr<Store>> Open(const std::filesystem::path& path);
  // Opens an existing database read-only, for the operator CLI. Fails with a
  // clear line if the file is missing or not an Estuary store.
  static Result<std::unique_ptr<Store>> OpenReadOnly(const std::filesystem::path& path);
  ~Store();

  Status SetMeta(const std::string& key, const std::string& value);
  Result<std::optional<std::string>> GetMeta(const std::string& key);

  Status ClientSeen(const std::string& name, const std::string& address, int64_t now_ms);

  // Inserts the round in state open (replacing an unfinished earlier attempt
  // at the same round number, whose rows are deleted).
  Status BeginRound(const RoundRecord& record);
  // Records a transition and sets rounds.state = to.
  Status Transition(uint64_t round, RoundState from, RoundState to, int64_t now_ms,
                    const std::string& detail = {});
  Status UpsertParticipation(const Participation& p);
  // In one transaction: the round's final fields, state committed, the
  // aggregating -> committed transition, and the checkpoint index row.
  Status CommitRound(const RoundRecord& record, const std::filesystem::path& checkpoint,
                     int64_t now_ms);
  // The round's state becomes failed with `reason`; its participations stay.
  Status FailRound(uint64_t round, const std::string& reason, int64_t now_ms);
  Status RecordEvent(const Event& event);
  // A round's SecAgg+ record (written with CommitRound as well): for a
  // round that failed, how far the protocol got.
  Status RecordSecAgg(uint64_t round, const RoundSecAgg& secagg);
  // A committed round's federated evaluation, which runs after the commit.
  Status RecordEvaluation(uint64_t round, const RoundEvaluation& evaluation);

  // An asynchronous round's arrival (the round's row must exist).
  Status RecordArrival(const Arrival& arrival);
  // Round `round`'s arrivals in order; none in a synchronous round or a log
  // before schema 5.
  Result<std::vector<Arrival>> Arrivals(uint64_t round);

  Result<std::vector<RoundRecord>> Rounds();
  Result<std::optional<RoundRecord>> GetRound(uint64_t round);
  Result<std::optional<RoundRecord>> LastCommittedRound();
  // Path of the checkpoint written when `round` committed.
  Result<std::optional<std::string>> CheckpointFor(uint64_t round);
  Result<std::vector<Participation>> Participations(uint64_t round);
  Result<std::vector<ClientRecord>> Clients();
  Result<std::vector<::estuary::server::Transition>> Transitions(uint64_t round);
  // The last `limit` events, oldest first.
  Result<std::vector<Event>> Events(int limit = 100);
  // Events of `kind` whose detail starts with `detail_prefix`, all of them.
  Result<uint64_t> CountEvents(const std::string& kind, const std::string& detail_prefix);

 private:
  explicit Store(sqlite3* db) : db_(db) {}
  Status ReadPrivacy(RoundRecord& record);  // and the round's secagg and evaluation rows
  Status CommitRoundTransaction(const RoundRecord& record, const std::filesystem::path& checkpoint, int64_t now_ms);
  sqlite3* db_;
  bool has_privacy_ = false;  // schema 2: the round_privacy table exists
  bool has_secagg_ = false;   // schema 3: the round_secagg table exists
  bool has_evaluation_ = false;  // schema 4: the round_evaluation table exists
  bool has_consistency_ = false;  // schema 5: round_secagg has the consistency check's columns
  bool has_arrivals_ = false;    // schema 6: the round_arrivals table exists
};

int64_t NowMs();

}  // namespace estuary::server
