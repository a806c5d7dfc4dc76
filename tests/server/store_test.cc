// The round log on a real SQLite file.
#include <gtest/gtest.h>
#include <sqlite3.h>

#include "server/operator_views.h"
#include "server/store.h"
#include "server/watch.h"
#include "tests/e2e/harness.h"

namespace estuary::server {
namespace {

RoundRecord Round(uint64_t n) {
  RoundRecord r;
  r.round = n;
  r.started_ms = 1000 * int64_t(n);
  r.strategy = "fedavg";
  r.clients_selected = 2;
  return r;
}

TEST(Store, UsesWalAndKeepsWhatItWasToldAcrossReopen) {
  testing::TempDir dir;
  const auto path = dir / "rounds.db";
  {
    auto store = Store::Open(path);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    ASSERT_TRUE((*store)->SetMeta("model", "mlp").ok());
    ASSERT_TRUE((*store)->ClientSeen("site-a", "127.0.0.1:1000", 5).ok());
    ASSERT_TRUE((*store)->BeginRound(Round(1)).ok());
    ASSERT_TRUE((*store)->Transition(1, RoundState::kOpen, RoundState::kCollecting, 6).ok());
    ASSERT_TRUE((*store)->UpsertParticipation({1, "site-a", "committed", 80, 0.5, 100, 200, 1.5, ""}).ok());
    ASSERT_TRUE((*store)->UpsertParticipation({1, "site-b", "dropped", 0, 0, 0, 200, 2.0, "connection lost"}).ok());
    RoundRecord done = Round(1);
    done.updates_received = 1;
    done.global_checksum = std::string(64, 'a');
    done.test_accuracy = 0.9;
    ASSERT_TRUE((*store)->CommitRound(done, dir / "global-r00001.safetensors", 7).ok());
  }
  sqlite3* raw = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &raw), SQLITE_OK);
  sqlite3_stmt* stmt = nullptr;
  sqlite3_prepare_v2(raw, "PRAGMA journal_mode", -1, &stmt, nullptr);
  ASSERT_EQ(sqlite3_step(stmt), SQLITE_ROW);
  EXPECT_STREQ(reinterpret_cast<const char*>(sqlite3_column_text(stmt, 0)), "wal");
  sqlite3_finalize(stmt);
  sqlite3_close(raw);

  auto store = Store::OpenReadOnly(path);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto last = (*store)->LastCommittedRound();
  ASSERT_TRUE(last.ok() && last->has_value());
  EXPECT_EQ((*last)->updates_received, 1u);
  EXPECT_EQ((*last)->test_accuracy, 0.9);
  EXPECT_FALSE((*last)->test_loss.has_value());
  auto clients = (*store)->Clients();
  ASSERT_TRUE(clients.ok());
  ASSERT_EQ(clients->size(), 1u);
  EXPECT_EQ((*clients)[0].rounds_joined, 1u);
  auto transitions = (*store)->Transitions(1);
  ASSERT_TRUE(transitions.ok());
  ASSERT_EQ(transitions->size(), 2u);
  EXPECT_EQ((*transitions)[1].to, RoundState::kCommitted);
  auto meta = (*store)->GetMeta("model");
  ASSERT_TRUE(meta.ok() && meta->has_value());
  EXPECT_EQ(**meta, "mlp");
  std::string text;
  ASSERT_TRUE(ShowRound(**store, 1, false, &text).ok());
  EXPECT_NE(text.find("connection lost"), std::string::npos) << text;
  ASSERT_TRUE(ListRounds(**store, false, &text).ok());
  EXPECT_NE(text.find("aaaaaaaaaaaa"), std::string::npos) << text;
  Status missing = ShowRound(**store, 4, false, &text);
  EXPECT_EQ(missing.code(), Code::kNotFound);
}

TEST(Store, AnUnfinishedRoundIsReplacedAndACommittedOneIsNot) {
  testing::TempDir dir;
  auto store = Store::Open(dir / "rounds.db");
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->BeginRound(Round(1)).ok());
  ASSERT_TRUE((*store)->UpsertParticipation({1, "site-a", "selected", 0, 0, 0, 0, 0, ""}).ok());
  ASSERT_TRUE((*store)->FailRound(1, "0 of 2 updates", 9).ok());
  auto last = (*store)->LastCommittedRound();
  ASSERT_TRUE(last.ok());
  EXPECT_FALSE(last->has_value());  // a failed round is not a committed one
  ASSERT_TRUE((*store)->BeginRound(Round(1)).ok());
  auto participations = (*store)->Participations(1);
  ASSERT_TRUE(participations.ok());
  EXPECT_TRUE(participations->empty());  // the failed attempt's rows went with it
  RoundRecord done = Round(1);
  done.global_checksum = std::string(64, 'b');
  ASSERT_TRUE((*store)->CommitRound(done, dir / "c1", 10).ok());
  Status again = (*store)->BeginRound(Round(1));
  EXPECT_EQ(again.code(), Code::kFailedPrecondition) << again.ToString();
  // A second commit of the same round fails as a whole: the checkpoint row
  // already exists, so the round row keeps its first values.
  RoundRecord twice = done;
  twice.updates_received = 42;
  EXPECT_FALSE((*store)->CommitRound(twice, dir / "c1-again", 11).ok());
  auto round = (*store)->GetRound(1);
  ASSERT_TRUE(round.ok() && round->has_value());
  EXPECT_EQ((*round)->updates_received, 0u);
}

// Events outlive the rounds they speak of (a retried round replaces its
// row): the coordinator counts a round's failed tries from them.
TEST(Store, EventsAreCountedByKindAndTheStartOfTheirDetail) {
  testing::TempDir dir;
  auto store = Store::Open(dir / "rounds.db");
  ASSERT_TRUE(store.ok());
  for (const auto& [kind, detail] : std::vector<std::pair<std::string, std::string>>{
           {"round_failed", "round 1 try 1: 0 of 2"}, {"round_failed", "round 1 try 2: 1 of 2"},
           {"round_failed", "round 12 try 1: 0 of 2"}, {"frame_rejected", "round 1 try 3"}}) {
    ASSERT_TRUE((*store)->RecordEvent({.at_ms = 1, .kind = kind, .detail = detail}).ok());
  }
  ASSERT_TRUE((*store)->BeginRound(Round(1)).ok());
  EXPECT_EQ((*store)->CountEvents("round_failed", "round 1 try ").value(), 2u);
  EXPECT_EQ((*store)->CountEvents("round_failed", "round 12 try ").value(), 1u);
  EXPECT_EQ((*store)->CountEvents("round_failed", "round 2 try ").value(), 0u);
  EXPECT_EQ((*store)->CountEvents("frame_rejected", "").value(), 1u);
}

TEST(Store, ReadOnlyOpenNamesTheFileAndTheProblem) {
  testing::TempDir dir;
  auto missing = Store::OpenReadOnly(dir / "nope.db");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("nope.db"), std::string::npos);
  sqlite3* raw = nullptr;
  ASSERT_EQ(sqlite3_open((dir / "other.db").c_str(), &raw), SQLITE_OK);
  sqlite3_exec(raw, "CREATE TABLE t(x)", nullptr, nullptr, nullptr);
  sqlite3_close(raw);
  auto foreign = Store::OpenReadOnly(dir / "other.db");
  ASSERT_FALSE(foreign.ok());
  EXPECT_NE(foreign.status().message().find("not an Estuary round log"), std::string::npos);
  auto writable = Store::Open(dir / "other.db");
  ASSERT_FALSE(writable.ok());
  EXPECT_NE(writable.status().message().find("other.db"), std::string::npos);
}

TEST(Store, ADpRoundsPrivacyIsCommittedWithItAndShownToTheOperator) {
  testing::TempDir dir;
  auto store = Store::Open(dir / "rounds.db");
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->BeginRound(Round(1)).ok());
  RoundRecord done = Round(1);
  done.global_checksum = std::string(64, 'c');
  done.privacy = RoundPrivacy{.sampling_rate = 0.1, .noise_multiplier = 1.1, .clip = 0.5, .noise_stddev = 0.55,
                              .epsilon = 0.8125, .delta = 1e-5};
  ASSERT_TRUE((*store)->CommitRound(done, dir / "c1", 10).ok());
  auto round = (*store)->GetRound(1);
  ASSERT_TRUE(round.ok() && round->has_value());
  ASSERT_TRUE((*round)->privacy.has_value());
  EXPECT_EQ((*round)->privacy->epsilon, 0.8125);
  EXPECT_EQ((*round)->privacy->sampling_rate, 0.1);
  EXPECT_EQ((*round)->privacy->noise_stddev, 0.55);
  std::string text;
  ASSERT_TRUE(ListRounds(**store, false, &text).ok());
  EXPECT_NE(text.find("0.8125"), std::string::npos) << text;
  EXPECT_NE(text.find("δ = 1e-05"), std::string::npos) << text;
  ASSERT_TRUE(ListRounds(**store, true, &text).ok());
  EXPECT_NE(text.find("\"epsilon\": 0.8125"), std::string::npos) << text;
  ASSERT_TRUE(ShowRound(**store, 1, false, &text).ok());
  EXPECT_NE(text.find("ε 0.8125 at δ 1e-05"), std::string::npos) << text;
  // A round retried after a failure loses the failed attempt's privacy row with it.
  ASSERT_TRUE((*store)->BeginRound(Round(2)).ok());
  ASSERT_TRUE((*store)->FailRound(2, "too few", 11).ok());
  auto failed = (*store)->GetRound(2);
  ASSERT_TRUE(failed.ok() && failed->has_value());
  EXPECT_FALSE((*failed)->privacy.has_value());
}

// A round log written before round_privacy existed (schema 1): the operator
// CLI reads it as it is, a server migrates it and then records privacy.
TEST(Store, ALogOfSchemaOneStillOpensAndIsMigratedByAServer) {
  testing::TempDir dir;
  const auto path = dir / "old.db";
  {
    auto store = Store::Open(path);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->BeginRound(Round(1)).ok());
    RoundRecord done = Round(1);
    done.global_checksum = std::string(64, 'd');
    ASSERT_TRUE((*store)->CommitRound(done, dir / "c1", 10).ok());
  }
  sqlite3* raw = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &raw), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(raw, "DROP TABLE round_privacy; PRAGMA user_version=1;", nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(raw);

  {
    auto old = Store::OpenReadOnly(path);
    ASSERT_TRUE(old.ok()) << old.status().ToString();
    std::string text;
    ASSERT_TRUE(ListRounds(**old, false, &text).ok());
    EXPECT_NE(text.find("dddddddddddd"), std::string::npos) << text;
    EXPECT_EQ(text.find("ε"), std::string::npos) << text;
  }
  auto migrated = Store::Open(path);
  ASSERT_TRUE(migrated.ok()) << migrated.status().ToString();
  ASSERT_TRUE((*migrated)->BeginRound(Round(2)).ok());
  RoundRecord two = Round(2);
  two.global_checksum = std::string(64, 'e');
  two.privacy = RoundPrivacy{.sampling_rate = 1, .noise_multiplier = 2, .clip = 1, .noise_stddev = 2,
                             .epsilon = 3, .delta = 1e-6};
  ASSERT_TRUE((*migrated)->CommitRound(two, dir / "c2", 12).ok());
  auto rounds = (*migrated)->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 2u);
  EXPECT_FALSE((*rounds)[0].privacy.has_value());
  ASSERT_TRUE((*rounds)[1].privacy.has_value());
  EXPECT_EQ((*rounds)[1].privacy->epsilon, 3);
}

// A SecAgg+ round's stages round-trip through the log, committed or failed,
// and the operator sees them; a plain round says so.
TEST(Store, ASecAggRoundRecordsItsStagesAndAPlainOneSaysPlain) {
  testing::TempDir dir;
  auto store = Store::Open(dir / "rounds.db");
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->BeginRound(Round(1)).ok());
  RoundRecord one = Round(1);
  one.global_checksum = std::string(64, 'a');
  one.secagg = RoundSecAgg{.stage = "done", .sites = 5, .neighbours = 4, .threshold = 3, .bits = 32, .clip = 100,
                           .scale = 4772, .answered = {5, 5, 4, 3, 3}, .dropouts = {0, 0, 1, 1, 0},
                           .bytes_up = {400, 3600, 3200000, 270, 900}, .bytes_down = {1500, 3400, 96, 1200, 0}};
  ASSERT_TRUE((*store)->CommitRound(one, dir / "c1", 10).ok());
  ASSERT_TRUE((*store)->BeginRound(Round(2)).ok());
  RoundSecAgg aborted{.stage = "masked input", .sites = 4, .neighbours = 3, .threshold = 3, .bits = 32, .clip = 100,
                      .scale = 1, .answered = {4, 4, 2, 0, 0}, .dropouts = {0, 0, 2, 0, 0}};
  ASSERT_TRUE((*store)->RecordSecAgg(2, aborted).ok());
  ASSERT_TRUE((*store)->FailRound(2, "secagg round 2: masked input: 2 of 4 sites remain", 11).ok());
  ASSERT_TRUE((*store)->BeginRound(Round(3)).ok());
  RoundRecord three = Round(3);
  three.global_checksum = std::string(64, 'c');
  ASSERT_TRUE((*store)->CommitRound(three, dir / "c3", 12).ok());

  auto rounds = (*store)->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 3u);
  ASSERT_TRUE((*rounds)[0].secagg.has_value());
  EXPECT_EQ((*rounds)[0].secagg->answered, one.secagg->answered);
  EXPECT_EQ((*rounds)[0].secagg->dropouts, one.secagg->dropouts);
  EXPECT_EQ((*rounds)[0].secagg->bytes_up, one.secagg->bytes_up);
  EXPECT_EQ((*rounds)[0].secagg->bytes_down, one.secagg->bytes_down);
  EXPECT_EQ((*rounds)[0].secagg->scale, 4772);
  ASSERT_TRUE((*rounds)[1].secagg.has_value());
  EXPECT_EQ((*rounds)[1].secagg->stage, "masked input");
  EXPECT_EQ((*rounds)[1].secagg->dropouts, aborted.dropouts);
  EXPECT_FALSE((*rounds)[2].secagg.has_value());

  std::string text;
  ASSERT_TRUE(ShowRound(**store, 1, false, &text).ok());
  EXPECT_NE(text.find("protocol  secagg: 5 sites, k 4, t 3, 32 bits, clip 100, scale 4772; reached done"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("masked input" + std::string(14, ' ') + "4" + std::string(9, ' ') + "1" + std::string(7, ' ') + "3200000"), std::string::npos) << text;
  EXPECT_NE(text.find("consistency check" + std::string(9, ' ') + "3" + std::string(9, ' ') + "1" + std::string(11, ' ') + "270" + std::string(10, ' ') + "1200"), std::string::npos) << text;
  ASSERT_TRUE(ShowRound(**store, 2, true, &text).ok());
  EXPECT_NE(text.find("\"stage_reached\": \"masked input\""), std::string::npos) << text;
  ASSERT_TRUE(ShowRound(**store, 3, false, &text).ok());
  EXPECT_NE(text.find("protocol  plain"), std::string::npos) << text;
  ASSERT_TRUE(ShowRound(**store, 3, true, &text).ok());
  EXPECT_NE(text.find("\"protocol\": \"plain\""), std::string::npos) << text;
}

// A round log of schema 4 (round_secagg without the consistency check's
// columns): its secagg rounds read zeros for that stage, and a server adds
// the columns without touching them.
TEST(Store, ASchemaFourSecAggRoundReadsNoConsistencyCheckAndIsMigrated) {
  testing::TempDir dir;
  const auto path = dir / "old.db";
  {
    auto store = Store::Open(path);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->BeginRound(Round(1)).ok());
    RoundRecord done = Round(1);
    done.global_checksum = std::string(64, 'd');
    ASSERT_TRUE((*store)->CommitRound(done, dir / "c1", 10).ok());
  }
  sqlite3* raw = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &raw), SQLITE_OK);
  // round_secagg as schema 3 and 4 made it, with round 1's four stages.
  ASSERT_EQ(sqlite3_exec(raw,
                         "DROP TABLE round_secagg; CREATE TABLE round_secagg (round INTEGER PRIMARY KEY REFERENCES "
                         "rounds(round) ON DELETE CASCADE, stage TEXT NOT NULL, sites INTEGER NOT NULL, neighbours "
                         "INTEGER NOT NULL, threshold INTEGER NOT NULL, bits INTEGER NOT NULL, clip REAL NOT NULL, "
                         "scale REAL NOT NULL, answered_advertise INTEGER NOT NULL, answered_share INTEGER NOT NULL, "
                         "answered_masked INTEGER NOT NULL, answered_unmask INTEGER NOT NULL, dropped_advertise "
                         "INTEGER NOT NULL, dropped_share INTEGER NOT NULL, dropped_masked INTEGER NOT NULL, "
                         "dropped_unmask INTEGER NOT NULL, up_advertise INTEGER NOT NULL, up_share INTEGER NOT NULL, "
                         "up_masked INTEGER NOT NULL, up_unmask INTEGER NOT NULL, down_advertise INTEGER NOT NULL, "
                         "down_share INTEGER NOT NULL, down_masked INTEGER NOT NULL, down_unmask INTEGER NOT NULL); "
                         "INSERT INTO round_secagg VALUES(1, 'done', 3, 2, 2, 32, 100, 5, 3, 3, 3, 2, 0, 0, 0, 1, 10, "
                         "20, 30, 40, 50, 60, 70, 80); PRAGMA user_version=4;",
                         nullptr, nullptr, nullptr),
            SQLITE_OK);
  sqlite3_close(raw);
  auto expect_round_one = [](Store& store) {
    auto round = store.GetRound(1);
    ASSERT_TRUE(round.ok() && round->has_value()) << round.status().ToString();
    ASSERT_TRUE((*round)->secagg.has_value());
    const RoundSecAgg& a = *(*round)->secagg;
    EXPECT_EQ(a.answered, (std::array<uint32_t, 5>{3, 3, 3, 0, 2}));
    EXPECT_EQ(a.dropouts, (std::array<uint32_t, 5>{0, 0, 0, 0, 1}));
    EXPECT_EQ(a.bytes_up, (std::array<uint64_t, 5>{10, 20, 30, 0, 40}));
    EXPECT_EQ(a.bytes_down, (std::array<uint64_t, 5>{50, 60, 70, 0, 80}));
  };
  {
    auto old = Store::OpenReadOnly(path);
    ASSERT_TRUE(old.ok()) << old.status().ToString();
    expect_round_one(**old);
  }
  auto migrated = Store::Open(path);
  ASSERT_TRUE(migrated.ok()) << migrated.status().ToString();
  expect_round_one(**migrated);
  ASSERT_TRUE((*migrated)->BeginRound(Round(2)).ok());
  RoundRecord two = Round(2);
  two.global_checksum = std::string(64, 'e');
  two.secagg = RoundSecAgg{.stage = "done", .sites = 3, .neighbours = 2, .threshold = 2, .bits = 32,
                           .answered = {3, 3, 3, 3, 3}, .bytes_up = {1, 2, 3, 4, 5}};
  ASSERT_TRUE((*migrated)->CommitRound(two, dir / "c2", 12).ok());
  auto round = (*migrated)->GetRound(2);
  ASSERT_TRUE(round.ok() && round->has_value());
  EXPECT_EQ((*round)->secagg->answered, two.secagg->answered);
  EXPECT_EQ((*round)->secagg->bytes_up, two.secagg->bytes_up);
}

// A round log of schema 2 (before round_secagg): read as it is, migrated by a server.
TEST(Store, ALogOfSchemaTwoStillOpensAndIsMigratedByAServer) {
  testing::TempDir dir;
  const auto path = dir / "old.db";
  {
    auto store = Store::Open(path);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->BeginRound(Round(1)).ok());
    RoundRecord done = Round(1);
    done.global_checksum = std::string(64, 'd');
    ASSERT_TRUE((*store)->CommitRound(done, dir / "c1", 10).ok());
  }
  sqlite3* raw = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &raw), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(raw, "DROP TABLE round_secagg; PRAGMA user_version=2;", nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(raw);
  {
    auto old = Store::OpenReadOnly(path);
    ASSERT_TRUE(old.ok()) << old.status().ToString();
    std::string text;
    ASSERT_TRUE(ShowRound(**old, 1, false, &text).ok());
    EXPECT_NE(text.find("protocol  plain"), std::string::npos) << text;
  }
  auto migrated = Store::Open(path);
  ASSERT_TRUE(migrated.ok()) << migrated.status().ToString();
  ASSERT_TRUE((*migrated)->BeginRound(Round(2)).ok());
  RoundRecord two = Round(2);
  two.global_checksum = std::string(64, 'e');
  two.secagg = RoundSecAgg{.stage = "done", .sites = 3, .neighbours = 2, .threshold = 2, .bits = 32};
  ASSERT_TRUE((*migrated)->CommitRound(two, dir / "c2", 12).ok());
  auto rounds = (*migrated)->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 2u);
  EXPECT_FALSE((*rounds)[0].secagg.has_value());
  ASSERT_TRUE((*rounds)[1].secagg.has_value());
  EXPECT_EQ((*rounds)[1].secagg->sites, 3u);
}

// rounds watch's view of a log with one round committed and one collecting.
TEST(Store, TheWatchShowsTheRunningRoundsArrivalsAndTheTimeLeft) {
  testing::TempDir dir;
  auto store = Store::Open(dir / "rounds.db");
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  Store& s = **store;
  for (auto [key, value] : {std::pair{"federation_id", "0123456789abcdef"}, std::pair{"model", "mlp"},
                            std::pair{"strategy", "fedavg"}, std::pair{"rounds", "10"}, std::pair{"complete", ""}}) {
    ASSERT_TRUE(s.SetMeta(key, value).ok());
  }
  ASSERT_TRUE(s.BeginRound(Round(1)).ok());
  RoundRecord done = Round(1);
  done.updates_received = 2;
  done.train_loss = 0.25;
  done.global_checksum = std::string(64, 'a');
  done.test_accuracy = 0.9;
  done.ended_ms = 3000;
  ASSERT_TRUE(s.CommitRound(done, dir / "global-r00001.safetensors", 3000).ok());
  RoundRecord running = Round(2);
  running.started_ms = 4000;
  running.clients_selected = 3;
  ASSERT_TRUE(s.BeginRound(running).ok());
  ASSERT_TRUE(s.Transition(2, RoundState::kOpen, RoundState::kCollecting, 4001).ok());
  ASSERT_TRUE(s.UpsertParticipation({2, "site-a", "committed", 80, 0.5, 100, 200, 1.5, ""}).ok());
  ASSERT_TRUE(s.UpsertParticipation({2, "site-b", "selected", 0, 0, 0, 200, 0, ""}).ok());
  ASSERT_TRUE(s.UpsertParticipation({2, "site-c", "dropped", 0, 0, 0, 200, 2.0, "connection lost"}).ok());

  auto frame = ReadWatchFrame(s, 5500);
  ASSERT_TRUE(frame.ok()) << frame.status().ToString();
  EXPECT_EQ(RenderWatchFrame(*frame),
            "federation 0123456789ab · mlp · fedavg · 1 committed, 0 failed\n"
            "now   round 2 of 10 collecting: 1 of 3 updates (1 committed, 1 training, 1 dropped) (1.5 s)\n"
            "last  round 1 committed in 2.0 s: train loss 0.2500, test accuracy 0.9000\n"
            "eta   18.0 s (2.0 s a round, 9 rounds left)");
  EXPECT_EQ(DescribeWatchFrame(*frame), "round 2 of 10 collecting: 1 of 3 updates (1 committed, 1 training, 1 dropped)")
      << "no clock in what changes are detected by";
  ASSERT_TRUE(s.SetMeta("complete", "2").ok());
  frame = ReadWatchFrame(s, 5500);
  ASSERT_TRUE(frame.ok());
  EXPECT_TRUE(frame->complete);
}

// A round log of schema 3 (before round_evaluation): the operator reads it
// as it is; a server migrates it, and an evaluated round's figures then
// round-trip and show in `rounds list` and `rounds show` (text and JSON).
TEST(Store, ALogOfSchemaThreeIsMigratedAndAnEvaluatedRoundShowsItsFigures) {
  testing::TempDir dir;
  const auto path = dir / "old.db";
  {
    auto store = Store::Open(path);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->BeginRound(Round(1)).ok());
    RoundRecord done = Round(1);
    done.global_checksum = std::string(64, 'd');
    ASSERT_TRUE((*store)->CommitRound(done, dir / "c1", 10).ok());
  }
  sqlite3* raw = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &raw), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(raw, "DROP TABLE round_evaluation; PRAGMA user_version=3;", nullptr, nullptr, nullptr),
            SQLITE_OK);
  sqlite3_close(raw);
  {
    auto old = Store::OpenReadOnly(path);
    ASSERT_TRUE(old.ok()) << old.status().ToString();
    auto rounds = (*old)->Rounds();
    ASSERT_TRUE(rounds.ok()) << rounds.status().ToString();
    EXPECT_FALSE((*rounds)[0].evaluation.has_value());
    std::string text;
    ASSERT_TRUE(ListRounds(**old, false, &text).ok());
    EXPECT_EQ(text.find("fed acc"), std::string::npos) << text;
    ASSERT_TRUE(ShowRound(**old, 1, true, &text).ok());
    EXPECT_NE(text.find("\"federated_evaluation\": null"), std::string::npos) << text;
  }
  auto migrated = Store::Open(path);
  ASSERT_TRUE(migrated.ok()) << migrated.status().ToString();
  ASSERT_TRUE((*migrated)->BeginRound(Round(2)).ok());
  RoundRecord two = Round(2);
  two.global_checksum = std::string(64, 'e');
  ASSERT_TRUE((*migrated)->CommitRound(two, dir / "c2", 12).ok());
  const RoundEvaluation evaluation{.selected = 4, .reported = 2, .unsupported = 1, .failed = 1, .examples = 80,
                                   .loss = 0.625, .accuracy = 0.8125, .accuracy_examples = 80, .seconds = 1.5};
  ASSERT_TRUE((*migrated)->RecordEvaluation(2, evaluation).ok());
  auto rounds = (*migrated)->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 2u);
  EXPECT_FALSE((*rounds)[0].evaluation.has_value());
  ASSERT_TRUE((*rounds)[1].evaluation.has_value());
  const RoundEvaluation& back = *(*rounds)[1].evaluation;
  EXPECT_EQ(back.selected, 4u);
  EXPECT_EQ(back.reported, 2u);
  EXPECT_EQ(back.unsupported, 1u);
  EXPECT_EQ(back.failed, 1u);
  EXPECT_EQ(back.examples, 80u);
  EXPECT_EQ(back.loss, 0.625);
  EXPECT_EQ(back.accuracy, 0.8125);
  EXPECT_EQ(back.accuracy_examples, 80u);
  EXPECT_EQ(back.seconds, 1.5);
  // A round whose sites reported no accuracy keeps it null.
  RoundEvaluation no_accuracy = evaluation;
  no_accuracy.accuracy.reset();
  ASSERT_TRUE((*migrated)->RecordEvaluation(1, no_accuracy).ok());
  auto one = (*migrated)->GetRound(1);
  ASSERT_TRUE(one.ok() && one->has_value() && (*one)->evaluation);
  EXPECT_FALSE((*one)->evaluation->accuracy.has_value());

  std::string text;
  ASSERT_TRUE(ListRounds(**migrated, false, &text).ok());
  EXPECT_NE(text.find("fed acc"), std::string::npos) << text;
  EXPECT_NE(text.find("0.8125     0.6250"), std::string::npos) << text;
  ASSERT_TRUE(ShowRound(**migrated, 2, false, &text).ok());
  EXPECT_NE(text.find("federated accuracy 0.8125, loss 0.6250 over 80 held-out examples of 2 of 4 sites (1 do not "
                      "evaluate, 1 failed; 1.50 s)"),
            std::string::npos)
      << text;
  ASSERT_TRUE(ShowRound(**migrated, 2, true, &text).ok());
  EXPECT_NE(text.find("\"sites_unsupported\": 1"), std::string::npos) << text;
  EXPECT_NE(text.find("\"accuracy\": 0.8125"), std::string::npos) << text;
  ASSERT_TRUE(ShowRound(**migrated, 1, true, &text).ok());
  EXPECT_NE(text.find("\"accuracy\": null"), std::string::npos) << text;
}

TEST(Store, ALogOfSchemaFiveIsMigratedAndAnAsyncVersionShowsItsArrivals) {
  testing::TempDir dir;
  const auto path = dir / "old.db";
  {
    auto store = Store::Open(path);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->BeginRound(Round(1)).ok());
    RoundRecord done = Round(1);
    done.global_checksum = std::string(64, 'd');
    ASSERT_TRUE((*store)->CommitRound(done, dir / "c1", 10).ok());
  }
  sqlite3* raw = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &raw), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(raw, "DROP TABLE round_arrivals; PRAGMA user_version=5;", nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(raw);
  {
    auto old = Store::OpenReadOnly(path);
    ASSERT_TRUE(old.ok()) << old.status().ToString();
    auto arrivals = (*old)->Arrivals(1);
    ASSERT_TRUE(arrivals.ok()) << arrivals.status().ToString();
    EXPECT_TRUE(arrivals->empty());
    std::string text;
    ASSERT_TRUE(ShowRound(**old, 1, true, &text).ok());
    EXPECT_NE(text.find("\"arrivals\": []"), std::string::npos) << text;
    EXPECT_TRUE((*old)->Clients().ok()) << "a log without round_arrivals still lists its sites";
  }
  auto migrated = Store::Open(path);
  ASSERT_TRUE(migrated.ok()) << migrated.status().ToString();
  RoundRecord two = Round(2);
  two.strategy = "fedbuff";
  ASSERT_TRUE((*migrated)->BeginRound(two).ok());
  const Arrival fresh{.round = 2, .seq = 1, .client = "site-a", .status = "folded", .trained_from = 1,
                      .staleness = 0, .weight = 1, .examples = 40, .train_loss = 0.5, .bytes_up = 400,
                      .seconds = 1.25, .at_ms = 20, .detail = ""};
  Arrival stale = fresh;
  stale.seq = 2;
  stale.client = "site-b";
  stale.trained_from = 0;
  stale.staleness = 1;
  stale.weight = 0.7071067811865476;
  Arrival refused = stale;
  refused.seq = 3;
  refused.status = "stale";
  refused.staleness = 4;
  refused.weight = 0;
  refused.detail = "4 versions stale";
  for (const Arrival& a : {stale, refused, fresh}) ASSERT_TRUE((*migrated)->RecordArrival(a).ok());
  EXPECT_FALSE((*migrated)->RecordArrival(fresh).ok()) << "one row per arrival";
  auto back = (*migrated)->Arrivals(2);
  ASSERT_TRUE(back.ok());
  ASSERT_EQ(back->size(), 3u);
  EXPECT_EQ((*back)[0].client, "site-a");
  EXPECT_EQ((*back)[1].staleness, 1u);
  EXPECT_EQ((*back)[1].weight, 0.7071067811865476);
  EXPECT_EQ((*back)[2].status, "stale");
  EXPECT_EQ((*back)[2].detail, "4 versions stale");
  EXPECT_EQ((*back)[0].seconds, 1.25);
  std::string text;
  ASSERT_TRUE(ShowRound(**migrated, 2, true, &text).ok());
  EXPECT_NE(text.find("\"weight\": 0.7071067811865476"), std::string::npos) << text;
  EXPECT_NE(text.find("\"trained_from\": 0"), std::string::npos) << text;
  ASSERT_TRUE(ShowRound(**migrated, 2, false, &text).ok());
  EXPECT_NE(text.find("arrivals (asynchronous"), std::string::npos) << text;
  EXPECT_NE(text.find("site-b                stale"), std::string::npos) << text;
  // A version begun again after a restart starts with no arrivals: the buffer was not checkpointed.
  ASSERT_TRUE((*migrated)->BeginRound(two).ok());
  EXPECT_TRUE((*migrated)->Arrivals(2)->empty());
}

// An asynchronous federation's work is arrivals, not participations: the
// operator's `clients` and `rounds watch` count them too.
TEST(Store, AsynchronousArrivalsCountForTheSitesAndTheWatch) {
  testing::TempDir dir;
  auto store = Store::Open(dir / "rounds.db");
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  Store& s = **store;
  ASSERT_TRUE(s.SetMeta("rounds", "4").ok());
  ASSERT_TRUE(s.ClientSeen("site-a", "127.0.0.1:1", 1).ok());
  ASSERT_TRUE(s.ClientSeen("site-b", "127.0.0.1:2", 2).ok());
  RoundRecord version = Round(1);
  version.strategy = "fedbuff";
  version.clients_selected = 5;
  ASSERT_TRUE(s.BeginRound(version).ok());
  ASSERT_TRUE(s.Transition(1, RoundState::kOpen, RoundState::kCollecting, 1001).ok());
  Arrival a{.round = 1, .seq = 1, .client = "site-a", .status = "folded", .weight = 1};
  ASSERT_TRUE(s.RecordArrival(a).ok());
  a.seq = 3;  // site-a again within the same version
  ASSERT_TRUE(s.RecordArrival(a).ok());
  Arrival b = a;
  b.seq = 2;
  b.client = "site-b";
  b.status = "stale";
  b.weight = 0;
  ASSERT_TRUE(s.RecordArrival(b).ok());
  b.seq = 4;
  b.status = "rejected";
  ASSERT_TRUE(s.RecordArrival(b).ok());

  auto clients = s.Clients();
  ASSERT_TRUE(clients.ok()) << clients.status().ToString();
  ASSERT_EQ(clients->size(), 2u);
  EXPECT_EQ((*clients)[0].rounds_joined, 2u);
  EXPECT_EQ((*clients)[0].rounds_dropped, 0u);
  EXPECT_EQ((*clients)[1].rounds_joined, 0u);
  EXPECT_EQ((*clients)[1].rounds_dropped, 2u);

  auto frame = ReadWatchFrame(s, 2500);
  ASSERT_TRUE(frame.ok()) << frame.status().ToString();
  EXPECT_EQ(DescribeWatchFrame(*frame), "round 1 of 4 collecting: 2 of 5 updates (2 committed, 1 rejected, 1 stale)");
}

}  // namespace
}  // namespace estuary::server
