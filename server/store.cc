#include "server/store.h"

#include <sqlite3.h>

#include <chrono>

#include "server/store_sql.h"

namespace estuary::server {

namespace {

using sql::Exec;
using sql::Statement;
using sql::Transaction;

// 2: round_privacy. 3: round_secagg. 4: round_evaluation. 5: round_secagg's consistency check.
// 6: round_arrivals.
constexpr int kSchemaVersion = 6;

constexpr const char* kSchema = R"sql(
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS clients (
  name TEXT PRIMARY KEY, first_seen_ms INTEGER NOT NULL, last_seen_ms INTEGER NOT NULL, last_address TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rounds (
  round INTEGER PRIMARY KEY, state TEXT NOT NULL, started_ms INTEGER NOT NULL, ended_ms INTEGER NOT NULL,
  model_version INTEGER NOT NULL, global_checksum TEXT NOT NULL, strategy TEXT NOT NULL,
  clients_selected INTEGER NOT NULL, updates_received INTEGER NOT NULL, train_loss REAL NOT NULL,
  test_accuracy REAL, test_loss REAL, bytes_up INTEGER NOT NULL, bytes_down INTEGER NOT NULL, detail TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS participations (
  round INTEGER NOT NULL REFERENCES rounds(round) ON DELETE CASCADE, client TEXT NOT NULL, status TEXT NOT NULL,
  examples INTEGER NOT NULL, train_loss REAL NOT NULL, bytes_up INTEGER NOT NULL, bytes_down INTEGER NOT NULL,
  seconds REAL NOT NULL, detail TEXT NOT NULL, PRIMARY KEY (round, client));
CREATE TABLE IF NOT EXISTS transitions (
  id INTEGER PRIMARY KEY AUTOINCREMENT, round INTEGER NOT NULL REFERENCES rounds(round) ON DELETE CASCADE,
  from_state TEXT NOT NULL, to_state TEXT NOT NULL, at_ms INTEGER NOT NULL, detail TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints (
  round INTEGER PRIMARY KEY, path TEXT NOT NULL, checksum TEXT NOT NULL, at_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS events (
  id INTEGER PRIMARY KEY AUTOINCREMENT, at_ms INTEGER NOT NULL, kind TEXT NOT NULL, peer TEXT NOT NULL,
  detail TEXT NOT NULL);
)sql";

// Schema 2, also what migrates a schema 1 log: its rounds simply have no row.
constexpr const char* kPrivacySchema = R"sql(
CREATE TABLE IF NOT EXISTS round_privacy (
  round INTEGER PRIMARY KEY REFERENCES rounds(round) ON DELETE CASCADE, sampling_rate REAL NOT NULL,
  noise_multiplier REAL NOT NULL, clip REAL NOT NULL, noise_stddev REAL NOT NULL, epsilon REAL NOT NULL,
  delta REAL NOT NULL);
)sql";

// Schema 3, also what migrates a schema 1 or 2 log: its rounds were plain.
constexpr const char* kSecAggSchema = R"sql(
CREATE TABLE IF NOT EXISTS round_secagg (
  round INTEGER PRIMARY KEY REFERENCES rounds(round) ON DELETE CASCADE, stage TEXT NOT NULL,
  sites INTEGER NOT NULL, neighbours INTEGER NOT NULL, threshold INTEGER NOT NULL, bits INTEGER NOT NULL,
  clip REAL NOT NULL, scale REAL NOT NULL,
  answered_advertise INTEGER NOT NULL, answered_share INTEGER NOT NULL, answered_masked INTEGER NOT NULL,
  answered_unmask INTEGER NOT NULL,
  dropped_advertise INTEGER NOT NULL, dropped_share INTEGER NOT NULL, dropped_masked INTEGER NOT NULL,
  dropped_unmask INTEGER NOT NULL,
  up_advertise INTEGER NOT NULL, up_share INTEGER NOT NULL, up_masked INTEGER NOT NULL, up_unmask INTEGER NOT NULL,
  down_advertise INTEGER NOT NULL, down_share INTEGER NOT NULL, down_masked INTEGER NOT NULL,
  down_unmask INTEGER NOT NULL);
)sql";

// Schema 5, also what migrates an older log: SecAgg+'s consistency check stage
// (its rounds had none: zeros).
constexpr const char* kConsistencySchema = R"sql(
ALTER TABLE round_secagg ADD COLUMN answered_consistency INTEGER NOT NULL DEFAULT 0;
ALTER TABLE round_secagg ADD COLUMN dropped_consistency INTEGER NOT NULL DEFAULT 0;
ALTER TABLE round_secagg ADD COLUMN up_consistency INTEGER NOT NULL DEFAULT 0;
ALTER TABLE round_secagg ADD COLUMN down_consistency INTEGER NOT NULL DEFAULT 0;
)sql";

// The stage columns of round_secagg, in RoundSecAgg::kStages' order.
constexpr const char* kSecAggStageColumns[RoundSecAgg::kStageCount] = {"advertise", "share", "masked", "consistency",
                                                                       "unmask"};

// A log older than schema 5 reads as zeros for the consistency check.
std::string SecAggColumns(bool consistency = true) {
  std::string out = "round, stage, sites, neighbours, threshold, bits, clip, scale";
  for (const char* kind : {"answered", "dropped", "up", "down"}) {
    for (const char* stage : kSecAggStageColumns) {
      out += consistency || std::string_view(stage) != "consistency" ? fmt::format(", {}_{}", kind, stage) : ", 0";
    }
  }
  return out;
}

// Schema 4, also what migrates an older log: its rounds were not evaluated by the sites.
constexpr const char* kEvaluationSchema = R"sql(
CREATE TABLE IF NOT EXISTS round_evaluation (
  round INTEGER PRIMARY KEY REFERENCES rounds(round) ON DELETE CASCADE, selected INTEGER NOT NULL,
  reported INTEGER NOT NULL, unsupported INTEGER NOT NULL, failed INTEGER NOT NULL, examples INTEGER NOT NULL,
  loss REAL NOT NULL, accuracy REAL, accuracy_examples INTEGER NOT NULL, seconds REAL NOT NULL);
)sql";

// Schema 6, also what migrates an older log: its rounds were synchronous.
constexpr const char* kArrivalsSchema = R"sql(
CREATE TABLE IF NOT EXISTS round_arrivals (
  round INTEGER NOT NULL REFERENCES rounds(round) ON DELETE CASCADE, seq INTEGER NOT NULL, client TEXT NOT NULL,
  status TEXT NOT NULL, trained_from INTEGER NOT NULL, staleness INTEGER NOT NULL, weight REAL NOT NULL,
  examples INTEGER NOT NULL, train_loss REAL NOT NULL, bytes_up INTEGER NOT NULL, seconds REAL NOT NULL,
  at_ms INTEGER NOT NULL, detail TEXT NOT NULL, PRIMARY KEY (round, seq));
)sql";

RoundState ParseState(const std::string& s) {
  if (s == "collecting") return RoundState::kCollecting;
  if (s == "aggregating") return RoundState::kAggregating;
  if (s == "committed") return RoundState::kCommitted;
  if (s == "failed") return RoundState::kFailed;
  return RoundState::kOpen;
}

constexpr const char* kRoundColumns =
    "round, state, started_ms, ended_ms, model_version, global_checksum, strategy, clients_selected, "
    "updates_received, train_loss, test_accuracy, test_loss, bytes_up, bytes_down, detail";
// kRoundColumns after `round`, as "col = ?" assignments for UPDATE.
constexpr const char* kRoundAssignments =
    "state = ?, started_ms = ?, ended_ms = ?, model_version = ?, global_checksum = ?, strategy = ?, "
    "clients_selected = ?, updates_received = ?, train_loss = ?, test_accuracy = ?, test_loss = ?, "
    "bytes_up = ?, bytes_down = ?, detail = ?";

// Binds every round field after `round`, in kRoundColumns order; INSERT and
// UPDATE both use it, so the two cannot drift apart.
Statement& BindRoundValues(Statement& s, const RoundRecord& r, RoundState state) {
  return s.Bind(std::string(RoundStateName(state)))
      .Bind(r.started_ms)
      .Bind(r.ended_ms)
      .Bind(r.model_version)
      .Bind(r.global_checksum)
      .Bind(r.strategy)
      .Bind(r.clients_selected)
      .Bind(r.updates_received)
      .Bind(r.train_loss)
      .Bind(r.test_accuracy)
      .Bind(r.test_loss)
      .Bind(r.bytes_up)
      .Bind(r.bytes_down)
      .Bind(r.detail);
}

RoundRecord ReadRound(const Statement& s) {
  RoundRecord r;
  r.round = uint64_t(s.Int(0));
  r.state = ParseState(s.Text(1));
  r.started_ms = s.Int(2);
  r.ended_ms = s.Int(3);
  r.model_version = uint64_t(s.Int(4));
  r.global_checksum = s.Text(5);
  r.strategy = s.Text(6);
  r.clients_selected = uint32_t(s.Int(7));
  r.updates_received = uint32_t(s.Int(8));
  r.train_loss = s.Real(9);
  r.test_accuracy = s.MaybeReal(10);
  r.test_loss = s.MaybeReal(11);
  r.bytes_up = uint64_t(s.Int(12));
  r.bytes_down = uint64_t(s.Int(13));
  r.detail = s.Text(14);
  return r;
}

}  // namespace

const char* RoundStateName(RoundState state) {
  switch (state) {
    case RoundState::kOpen: return "open";
    case RoundState::kCollecting: return "collecting";
    case RoundState::kAggregating: return "aggregating";
    case RoundState::kCommitted: return "committed";
    case RoundState::kFailed: return "failed";
  }
  return "?";
}

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Result<std::unique_ptr<Store>> Store::Open(const std::filesystem::path& path) {
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                      nullptr) != SQLITE_OK) {
    Status s = IoError("store: {}: cannot open: {}", path.string(), db ? sqlite3_errmsg(db) : "out of memory");
    sqlite3_close(db);
    return s;
  }
  std::unique_ptr<Store> store(new Store(db));
  sqlite3_busy_timeout(db, 5000);
  // WAL + synchronous=NORMAL: every transaction survives the process being
  // killed; CommitRound alone switches to FULL so a committed round also
  // survives power loss (and carries the WAL written before it to disk).
  ESTUARY_RETURN_IF_ERROR(Exec(db, "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA foreign_keys=ON;"));
  Statement version(db, "PRAGMA user_version");
  ESTUARY_ASSIGN_OR_RETURN(bool row, version.Step());
  const int64_t found = row ? version.Int(0) : 0;
  if (found > kSchemaVersion) {
    return FailedPrecondition("store: {}: schema version {} is newer than this server's {}", path.string(), found,
                              kSchemaVersion);
  }
  if (found == 0) {
    // A non-empty file without our schema version is someone else's database.
    Statement tables(db, "SELECT count(*) FROM sqlite_master");
    ESTUARY_ASSIGN_OR_RETURN(bool has, tables.Step());
    if (has && tables.Int(0) > 0) {
      return FailedPrecondition("store: {}: not an Estuary round log (a database without its schema)", path.string());
    }
    ESTUARY_RETURN_IF_ERROR(Exec(db, kSchema));
  }
  if (found < kSchemaVersion) {
    Transaction tx(db);
    ESTUARY_RETURN_IF_ERROR(tx.status());
    ESTUARY_RETURN_IF_ERROR(Exec(db, kPrivacySchema));
    ESTUARY_RETURN_IF_ERROR(Exec(db, kSecAggSchema));
    ESTUARY_RETURN_IF_ERROR(Exec(db, kEvaluationSchema));
    Statement consistency(db, "SELECT count(*) FROM pragma_table_info('round_secagg') WHERE name = "
                              "'answered_consistency'");
    ESTUARY_ASSIGN_OR_RETURN(bool counted, consistency.Step());
    if (!counted || consistency.Int(0) == 0) ESTUARY_RETURN_IF_ERROR(Exec(db, kConsistencySchema));
    ESTUARY_RETURN_IF_ERROR(Exec(db, kArrivalsSchema));
    ESTUARY_RETURN_IF_ERROR(Exec(db, fmt::format("PRAGMA user_version={}", kSchemaVersion).c_str()));
    ESTUARY_RETURN_IF_ERROR(tx.Commit());
  }
  store->has_privacy_ = true;
  store->has_secagg_ = true;
  store->has_evaluation_ = true;
  store->has_consistency_ = true;
  store->has_arrivals_ = true;
  return store;
}

Result<std::unique_ptr<Store>> Store::OpenReadOnly(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return NotFound("store: {}: no such round log", path.string());
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READONLY | SQLITE_OPEN_FULLMUTEX, nullptr) != SQLITE_OK) {
    Status s = IoError("store: {}: cannot open: {}", path.string(), db ? sqlite3_errmsg(db) : "out of memory");
    sqlite3_close(db);
    return s;
  }
  std::unique_ptr<Store> store(new Store(db));
  sqlite3_busy_timeout(db, 5000);
  Statement version(db, "PRAGMA user_version");
  auto row = version.Step();
  if (!row.ok() || !*row || version.Int(0) < 1 || version.Int(0) > kSchemaVersion) {
    return FailedPrecondition("store: {}: not an Estuary round log", path.string());
  }
  store->has_privacy_ = version.Int(0) >= 2;
  store->has_secagg_ = version.Int(0) >= 3;
  store->has_evaluation_ = version.Int(0) >= 4;
  store->has_consistency_ = version.Int(0) >= 5;
  store->has_arrivals_ = version.Int(0) >= 6;
  return store;
}

Store::~Store() { sqlite3_close(db_); }

Status Store::SetMeta(const std::string& key, const std::string& value) {
  Statement s(db_, "INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value");
  return s.Bind(key).Bind(value).Run();
}

Result<std::optional<std::string>> Store::GetMeta(const std::string& key) {
  Statement s(db_, "SELECT value FROM meta WHERE key = ?");
  ESTUARY_ASSIGN_OR_RETURN(bool row, s.Bind(key).Step());
  if (!row) return std::optional<std::string>();
  return std::optional<std::string>(s.Text(0));
}

Status Store::ClientSeen(const std::string& name, const std::string& address, int64_t now_ms) {
  Statement s(db_,
              "INSERT INTO clients(name, first_seen_ms, last_seen_ms, last_address) VALUES(?, ?, ?, ?) "
              "ON CONFLICT(name) DO UPDATE SET last_seen_ms = excluded.last_seen_ms, last_address = excluded.last_address");
  return s.Bind(name).Bind(now_ms).Bind(now_ms).Bind(address).Run();
}

Status Store::BeginRound(const RoundRecord& r) {
  Transaction tx(db_);
  ESTUARY_RETURN_IF_ERROR(tx.status());
  Statement existing(db_, "SELECT state FROM rounds WHERE round = ?");
  ESTUARY_ASSIGN_OR_RETURN(bool row, existing.Bind(r.round).Step());
  if (row && existing.Text(0) == "committed") {
    return FailedPrecondition("store: round {} is already committed", r.round);
  }
  // An unfinished attempt at this round (a crash, a failed round) is replaced whole.
  ESTUARY_RETURN_IF_ERROR(Statement(db_, "DELETE FROM rounds WHERE round = ?").Bind(r.round).Run());
  ESTUARY_RETURN_IF_ERROR(Statement(db_, "DELETE FROM checkpoints WHERE round = ?").Bind(r.round).Run());
  Statement insert(db_, fmt::format("INSERT INTO rounds({}) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                    kRoundColumns).c_str());
  ESTUARY_RETURN_IF_ERROR(BindRoundValues(insert.Bind(r.round), r, RoundState::kOpen).Run());
  return tx.Commit();
}

Status Store::Transition(uint64_t round, RoundState from, RoundState to, int64_t now_ms, const std::string& detail) {
  Transaction tx(db_);
  ESTUARY_RETURN_IF_ERROR(tx.status());
  ESTUARY_RETURN_IF_ERROR(
      Statement(db_, "INSERT INTO transitions(round, from_state, to_state, at_ms, detail) VALUES(?, ?, ?, ?, ?)")
          .Bind(round)
          .Bind(std::string(RoundStateName(from)))
          .Bind(std::string(RoundStateName(to)))
          .Bind(now_ms)
          .Bind(detail)
          .Run());
  ESTUARY_RETURN_IF_ERROR(Statement(db_, "UPDATE rounds SET state = ? WHERE round = ?")
                              .Bind(std::string(RoundStateName(to)))
                              .Bind(round)
                              .Run());
  return tx.Commit();
}

Status Store::UpsertParticipation(const Participation& p) {
  Statement s(db_,
              "INSERT INTO participations(round, client, status, examples, train_loss, bytes_up, bytes_down, seconds, "
              "detail) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(round, client) DO UPDATE SET "
              "status = excluded.status, examples = excluded.examples, train_loss = excluded.train_loss, "
              "bytes_up = excluded.bytes_up, bytes_down = excluded.bytes_down, seconds = excluded.seconds, "
              "detail = excluded.detail");
  return s.Bind(p.round)
      .Bind(p.client)
      .Bind(p.status)
      .Bind(p.examples)
      .Bind(p.train_loss)
      .Bind(p.bytes_up)
      .Bind(p.bytes_down)
      .Bind(p.seconds)
      .Bind(p.detail)
      .Run();
}

Status Store::CommitRound(const RoundRecord& r, const std::filesystem::path& checkpoint, int64_t now_ms) {
  ESTUARY_RETURN_IF_ERROR(Exec(db_, "PRAGMA synchronous=FULL"));
  Status committed = CommitRoundTransaction(r, checkpoint, now_ms);
  Status restored = Exec(db_, "PRAGMA synchronous=NORMAL");
  return committed.ok() ? restored : committed;
}

Status Store::CommitRoundTransaction(const RoundRecord& r, const std::filesystem::path& checkpoint, int64_t now_ms) {
  Transaction tx(db_);
  ESTUARY_RETURN_IF_ERROR(tx.status());
  Statement current(db_, "SELECT state FROM rounds WHERE round = ?");
  ESTUARY_ASSIGN_OR_RETURN(bool row, current.Bind(r.round).Step());
  if (!row) return FailedPrecondition("store: round {} was never begun", r.round);
  const std::string from = current.Text(0);
  Statement update(db_, fmt::format("UPDATE rounds SET {} WHERE round = ?", kRoundAssignments).c_str());
  ESTUARY_RETURN_IF_ERROR(BindRoundValues(update, r, RoundState::kCommitted).Bind(r.round).Run());
  ESTUARY_RETURN_IF_ERROR(
      Statement(db_, "INSERT INTO transitions(round, from_state, to_state, at_ms, detail) VALUES(?, ?, 'committed', ?, '')")
          .Bind(r.round)
          .Bind(from)
          .Bind(now_ms)
          .Run());
  ESTUARY_RETURN_IF_ERROR(Statement(db_, "INSERT INTO checkpoints(round, path, checksum, at_ms) VALUES(?, ?, ?, ?)")
                              .Bind(r.round)
                              .Bind(checkpoint.string())
                              .Bind(r.global_checksum)
                              .Bind(now_ms)
                              .Run());
  if (r.privacy) {
    const RoundPrivacy& p = *r.privacy;
    ESTUARY_RETURN_IF_ERROR(Statement(db_,
                                      "INSERT OR REPLACE INTO round_privacy(round, sampling_rate, noise_multiplier, "
                                      "clip, noise_stddev, epsilon, delta) VALUES(?, ?, ?, ?, ?, ?, ?)")
                                .Bind(r.round)
                                .Bind(p.sampling_rate)
                                .Bind(p.noise_multiplier)
                                .Bind(p.clip)
                                .Bind(p.noise_stddev)
                                .Bind(p.epsilon)
                                .Bind(p.delta)
                                .Run());
  }
  if (r.secagg) ESTUARY_RETURN_IF_ERROR(RecordSecAgg(r.round, *r.secagg));
  return tx.Commit();
}

Status Store::RecordSecAgg(uint64_t round, const RoundSecAgg& a) {
  std::string values = "?";
  for (int i = 1; i < 8 + 4 * RoundSecAgg::kStageCount; ++i) values += ", ?";
  Statement s(db_, fmt::format("INSERT OR REPLACE INTO round_secagg({}) VALUES({})", SecAggColumns(), values).c_str());
  s.Bind(round).Bind(a.stage).Bind(a.sites).Bind(a.neighbours).Bind(a.threshold).Bind(a.bits).Bind(a.clip).Bind(a.scale);
  for (uint32_t v : a.answered) s.Bind(v);
  for (uint32_t v : a.dropouts) s.Bind(v);
  for (uint64_t v : a.bytes_up) s.Bind(v);
  for (uint64_t v : a.bytes_down) s.Bind(v);
  return s.Run();
}

Status Store::RecordEvaluation(uint64_t round, const RoundEvaluation& e) {
  return Statement(db_,
                   "INSERT OR REPLACE INTO round_evaluation(round, selected, reported, unsupported, failed, examples, "
                   "loss, accuracy, accuracy_examples, seconds) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
      .Bind(round)
      .Bind(e.selected)
      .Bind(e.reported)
      .Bind(e.unsupported)
      .Bind(e.failed)
      .Bind(e.examples)
      .Bind(e.loss)
      .Bind(e.accuracy)
      .Bind(e.accuracy_examples)
      .Bind(e.seconds)
      .Run();
}

Status Store::FailRound(uint64_t round, const std::string& reason, int64_t now_ms) {
  Transaction tx(db_);
  ESTUARY_RETURN_IF_ERROR(tx.status());
  Statement current(db_, "SELECT state FROM rounds WHERE round = ?");
  ESTUARY_ASSIGN_OR_RETURN(bool row, current.Bind(round).Step());
  if (!row) return FailedPrecondition("store: round {} was never begun", round);
  ESTUARY_RETURN_IF_ERROR(
      Statement(db_, "INSERT INTO transitions(round, from_state, to_state, at_ms, detail) VALUES(?, ?, 'failed', ?, ?)")
          .Bind(round)
          .Bind(current.Text(0))
          .Bind(now_ms)
          .Bind(reason)
          .Run());
  ESTUARY_RETURN_IF_ERROR(
      Statement(db_, "UPDATE rounds SET state = 'failed', ended_ms = ?, detail = ? WHERE round = ?")
          .Bind(now_ms)
          .Bind(reason)
          .Bind(round)
          .Run());
  return tx.Commit();
}

Status Store::RecordEvent(const Event& e) {
  return Statement(db_, "INSERT INTO events(at_ms, kind, peer, detail) VALUES(?, ?, ?, ?)")
      .Bind(e.at_ms)
      .Bind(e.kind)
      .Bind(e.peer)
      .Bind(e.detail)
      .Run();
}

Result<std::vector<RoundRecord>> Store::Rounds() {
  Statement s(db_, fmt::format("SELECT {} FROM rounds ORDER BY round", kRoundColumns).c_str());
  std::vector<RoundRecord> out;
  for (;;) {
    ESTUARY_ASSIGN_OR_RETURN(bool row, s.Step());
    if (!row) return out;
    out.push_back(ReadRound(s));
    ESTUARY_RETURN_IF_ERROR(ReadPrivacy(out.back()));
  }
}

Status Store::ReadPrivacy(RoundRecord& record) {
  if (!has_privacy_) return Status::Ok();
  Statement s(db_,
              "SELECT sampling_rate, noise_multiplier, clip, noise_stddev, epsilon, delta FROM round_privacy "
              "WHERE round = ?");
  ESTUARY_ASSIGN_OR_RETURN(bool row, s.Bind(record.round).Step());
  if (row) {
    record.privacy = RoundPrivacy{.sampling_rate = s.Real(0),
                                  .noise_multiplier = s.Real(1),
                                  .clip = s.Real(2),
                                  .noise_stddev = s.Real(3),
                                  .epsilon = s.Real(4),
                                  .delta = s.Real(5)};
  }
  if (has_evaluation_) {
    Statement e(db_,
                "SELECT selected, reported, unsupported, failed, examples, loss, accuracy, accuracy_examples, seconds "
                "FROM round_evaluation WHERE round = ?");
    ESTUARY_ASSIGN_OR_RETURN(bool evaluated, e.Bind(record.round).Step());
    if (evaluated) {
      record.evaluation = RoundEvaluation{.selected = uint32_t(e.Int(0)),
                                          .reported = uint32_t(e.Int(1)),
                                          .unsupported = uint32_t(e.Int(2)),
                                          .failed = uint32_t(e.Int(3)),
                                          .examples = uint64_t(e.Int(4)),
                                          .loss = e.Real(5),
                                          .accuracy = e.MaybeReal(6),
                                          .accuracy_examples = uint64_t(e.Int(7)),
                                          .seconds = e.Real(8)};
    }
  }
  if (!has_secagg_) return Status::Ok();
  Statement a(db_, fmt::format("SELECT {} FROM round_secagg WHERE round = ?", SecAggColumns(has_consistency_)).c_str());
  ESTUARY_ASSIGN_OR_RETURN(bool found, a.Bind(record.round).Step());
  if (!found) return Status::Ok();
  RoundSecAgg& out = record.secagg.emplace();
  out.stage = a.Text(1);
  out.sites = uint32_t(a.Int(2));
  out.neighbours = uint32_t(a.Int(3));
  out.threshold = uint32_t(a.Int(4));
  out.bits = uint32_t(a.Int(5));
  out.clip = a.Real(6);
  out.scale = a.Real(7);
  constexpr int n = RoundSecAgg::kStageCount;
  for (int i = 0; i < n; ++i) {
    out.answered[i] = uint32_t(a.Int(8 + i));
    out.dropouts[i] = uint32_t(a.Int(8 + n + i));
    out.bytes_up[i] = uint64_t(a.Int(8 + 2 * n + i));
    out.bytes_down[i] = uint64_t(a.Int(8 + 3 * n + i));
  }
  return Status::Ok();
}

Result<std::optional<RoundRecord>> Store::GetRound(uint64_t round) {
  Statement s(db_, fmt::format("SELECT {} FROM rounds WHERE round = ?", kRoundColumns).c_str());
  ESTUARY_ASSIGN_OR_RETURN(bool row, s.Bind(round).Step());
  if (!row) return std::optional<RoundRecord>();
  RoundRecord record = ReadRound(s);
  ESTUARY_RETURN_IF_ERROR(ReadPrivacy(record));
  return std::optional<RoundRecord>(std::move(record));
}

Result<std::optional<RoundRecord>> Store::LastCommittedRound() {
  Statement s(db_, fmt::format("SELECT {} FROM rounds WHERE state = 'committed' ORDER BY round DESC LIMIT 1",
                               kRoundColumns).c_str());
  ESTUARY_ASSIGN_OR_RETURN(bool row, s.Step());
  if (!row) return std::optional<RoundRecord>();
  RoundRecord record = ReadRound(s);
  ESTUARY_RETURN_IF_ERROR(ReadPrivacy(record));
  return std::optional<RoundRecord>(std::move(record));
}

Result<std::optional<std::string>> Store::CheckpointFor(uint64_t round) {
  Statement s(db_, "SELECT path FROM checkpoints WHERE round = ?");
  ESTUARY_ASSIGN_OR_RETURN(bool row, s.Bind(round).Step());
  if (!row) return std::optional<std::string>();
  return std::optional<std::string>(s.Text(0));
}

Result<std::vector<Participation>> Store::Participations(uint64_t round) {
  Statement s(db_,
              "SELECT round, client, status, examples, train_loss, bytes_up, bytes_down, seconds, detail "
              "FROM participations WHERE round = ? ORDER BY client");
  s.Bind(round);
  std::vector<Participation> out;
  for (;;) {
    ESTUARY_ASSIGN_OR_RETURN(bool row, s.Step());
    if (!row) return out;
    out.push_back({uint64_t(s.Int(0)), s.Text(1), s.Text(2), uint64_t(s.Int(3)), s.Real(4), uint64_t(s.Int(5)),
                   uint64_t(s.Int(6)), s.Real(7), s.Text(8)});
  }
}

Result<std::vector<ClientRecord>> Store::Clients() {
  // A read-only log from before schema 6 has no round_arrivals.
  const std::string folded =
      has_arrivals_ ? " + (SELECT count(*) FROM round_arrivals a WHERE a.client = c.name AND a.status = 'folded')" : "";
  const std::string refused =
      has_arrivals_
          ? " + (SELECT count(*) FROM round_arrivals a WHERE a.client = c.name AND a.status IN ('stale', 'rejected'))"
          : "";
  const std::string sql =
      "SELECT c.name, c.first_seen_ms, c.last_seen_ms, c.last_address, "
      "(SELECT count(*) FROM participations p WHERE p.client = c.name AND p.status = 'committed')" + folded +
      ", (SELECT count(*) FROM participations p WHERE p.client = c.name AND p.status IN ('dropped', 'late'))" +
      refused + " FROM clients c ORDER BY c.name";
  Statement s(db_, sql.c_str());
  std::vector<ClientRecord> out;
  for (;;) {
    ESTUARY_ASSIGN_OR_RETURN(bool row, s.Step());
    if (!row) return out;
    out.push_back({s.Text(0), s.Int(1), s.Int(2), s.Text(3), uint64_t(s.Int(4)), uint64_t(s.Int(5))});
  }
}

Result<std::vector<Transition>> Store::Transitions(uint64_t round) {
  Statement s(db_, "SELECT round, from_state, to_state, at_ms, detail FROM transitions WHERE round = ? ORDER BY id");
  s.Bind(round);
  std::vector<server::Transition> out;
  for (;;) {
    ESTUARY_ASSIGN_OR_RETURN(bool row, s.Step());
    if (!row) return out;
    out.push_back({uint64_t(s.Int(0)), ParseState(s.Text(1)), ParseState(s.Text(2)), s.Int(3), s.Text(4)});
  }
}

Result<uint64_t> Store::CountEvents(const std::string& kind, const std::string& detail_prefix) {
  Statement s(db_, "SELECT COUNT(*) FROM events WHERE kind = ? AND substr(detail, 1, ?) = ?");
  s.Bind(kind).Bind(int64_t(detail_prefix.size())).Bind(detail_prefix);
  ESTUARY_ASSIGN_OR_RETURN(bool row, s.Step());
  if (!row) return Internal("store: COUNT(*) returned no row");
  return uint64_t(s.Int(0));
}

Result<std::vector<Event>> Store::Events(int limit) {
  Statement s(db_,
              "SELECT at_ms, kind, peer, detail FROM (SELECT id, at_ms, kind, peer, detail FROM events ORDER BY id DESC "
              "LIMIT ?) ORDER BY id");
  s.Bind(int64_t(limit));
  std::vector<Event> out;
  for (;;) {
    ESTUARY_ASSIGN_OR_RETURN(bool row, s.Step());
    if (!row) return out;
    out.push_back({s.Int(0), s.Text(1), s.Text(2), s.Text(3)});
  }
}

}  // namespace estuary::server
