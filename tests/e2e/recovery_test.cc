// The round log and the checkpoint directory, against crashes and damage,
// with the real binaries: a log emptied, deleted or stripped of its WAL is
// refused at start in one line and nothing is overwritten; and a federation
// killed with SIGKILL at seeded random moments, restart after restart, loses
// no committed round, applies none twice, and finishes.
#include <gtest/gtest.h>
#include <signal.h>

#include <fstream>
#include <random>

#include <fmt/ranges.h>

#include "crypto/sha256.h"
#include "models/checkpoint.h"
#include "tests/e2e/federation.h"

namespace estuary::testing {
namespace {

std::string FileSha256(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string bytes{std::istreambuf_iterator<char>(in), {}};
  return crypto::Sha256Hex(bytes.data(), bytes.size());
}

// Every checkpoint file's hash, by name: what must not change.
std::map<std::string, std::string> Snapshot(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    files[entry.path().filename().string()] = FileSha256(entry.path());
  }
  return files;
}

// Runs 2 rounds with one site to the end.
void RunTwoRounds(Federation& f) {
  f.Issue("site-a");
  const uint16_t port = f.StartServer(2, 1);
  auto client = f.StartClient("site-a", port);
  ASSERT_EQ(client->Wait(), 0) << f.ClientLog("site-a");
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
}

// Starts the server over the damaged log; it must exit 1 with one line
// (its last) holding `expected`, and leave the checkpoints as they were.
void ExpectRefusedAtStart(Federation& f, const std::string& expected) {
  const auto before = Snapshot(f.checkpoints());
  std::vector<std::string> argv = {BinaryPath("estuary-server").string()};
  const auto args = f.ServeArgs(2, 1);
  argv.insert(argv.end(), args.begin(), args.end());
  const fs::path log = f.dir() / "refused.log";
  ChildProcess server(argv, log);
  EXPECT_EQ(server.Wait(std::chrono::seconds(60)), 1);
  std::ifstream in(log);
  std::string line, last;
  while (std::getline(in, line)) {
    if (!line.empty()) last = line;
  }
  EXPECT_NE(last.find(expected), std::string::npos) << last;
  EXPECT_EQ(Snapshot(f.checkpoints()), before) << "a refused start changes no checkpoint";
}

TEST(Recovery, AnEmptiedRoundLogIsRefusedAndOverwritesNothing) {
  Federation f;
  RunTwoRounds(f);
  fs::resize_file(f.db(), 0);
  ExpectRefusedAtStart(f, "the log is missing, empty or truncated");
}

TEST(Recovery, ADeletedRoundLogIsRefusedAndOverwritesNothing) {
  Federation f;
  RunTwoRounds(f);
  for (const char* suffix : {"", "-wal", "-shm"}) fs::remove(f.db().string() + suffix);
  ExpectRefusedAtStart(f, "the log is missing, empty or truncated");
}

// A kill leaves the last commits in the WAL; without it the log is behind
// the directory, or empty.
TEST(Recovery, ALogThatLostItsWalAfterAKillIsRefused) {
  Federation f;
  f.Issue("site-a");
  // Far more rounds than reach the log before the kill: a server that
  // finished would close the log cleanly, folding its WAL in (SQLite folds
  // it in by itself only past 1000 pages, far beyond these few rounds).
  const uint16_t port = f.StartServer(1000, 1);
  auto client = f.StartClient("site-a", port);
  ASSERT_TRUE(f.AwaitCommitted(3)) << f.ServerLog();
  f.server().Kill();
  ASSERT_TRUE(fs::exists(f.db().string() + "-wal"));
  for (const char* suffix : {"-wal", "-shm"}) fs::remove(f.db().string() + suffix);
  const auto before = Snapshot(f.checkpoints());
  ASSERT_TRUE(before.contains("global-r00003.safetensors"));
  ExpectRefusedAtStart(f, "restore it");
}

// What the round log and the directory must say after any crash: rounds
// 1..L committed, each once (model version = round), every committed round's
// checkpoint hashing to the log's checksum, and L never going back.
void CheckAfterCrash(Federation& f, uint64_t& last_committed, int restart) {
  SCOPED_TRACE(fmt::format("after kill {}", restart));
  auto store = server::Store::OpenReadOnly(f.db());
  if (!store.ok()) {
    // Killed before the first start created the log.
    ASSERT_EQ(last_committed, 0u) << store.status().ToString();
    return;
  }
  auto rounds = (*store)->Rounds();
  ASSERT_TRUE(rounds.ok()) << rounds.status().ToString();
  uint64_t committed = 0;
  for (const auto& round : *rounds) {
    if (round.state != server::RoundState::kCommitted) continue;
    ++committed;
    EXPECT_EQ(round.round, committed) << "committed rounds are 1..L";
    EXPECT_EQ(round.model_version, round.round) << "round " << round.round << " applied once";
    auto path = (*store)->CheckpointFor(round.round);
    ASSERT_TRUE(path.ok() && path->has_value()) << round.round;
    auto checkpoint = models::LoadCheckpoint(**path);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
    EXPECT_EQ(crypto::Sha256Hex(checkpoint->data.data(), checkpoint->data.size() * sizeof(float)),
              round.global_checksum)
        << "round " << round.round;
  }
  EXPECT_GE(committed, last_committed) << "no committed round is lost";
  last_committed = committed;
}

TEST(Recovery, TwentyKillsAtRandomMomentsLoseNothingAndTheFederationFinishes) {
  constexpr uint64_t kRounds = 100;
  constexpr int kKills = 20;
  Federation f;
  f.Issue("site-a");
  f.Issue("site-b");
  const uint16_t port = FreePort();
  const std::string listen = fmt::format("127.0.0.1:{}", port);
  std::vector<std::unique_ptr<ChildProcess>> clients;
  // Each life lasts until 0 or 1 more round has committed, then a further
  // 0-150 ms: so the kills fall while the server recovers, while sites
  // reconnect, mid-round, mid-upload and mid-commit, and the federation is
  // still running at the last of them (rounds run in tens of milliseconds).
  std::mt19937 rng(2026);
  std::uniform_int_distribution<int> rounds_more(0, 1);
  std::uniform_int_distribution<int> moment_ms(0, 150);
  uint64_t last_committed = 0;
  std::vector<uint64_t> progress;  // rounds committed at each kill
  for (int kill = 1; kill <= kKills; ++kill) {
    std::vector<std::string> argv = {BinaryPath("estuary-server").string()};
    const auto args = f.ServeArgs(kRounds, 2, {}, listen);
    argv.insert(argv.end(), args.begin(), args.end());
    ChildProcess server(argv, f.dir() / fmt::format("server-{}.log", kill));
    if (clients.empty()) {
      clients.push_back(f.StartClient("site-a", port));
      clients.push_back(f.StartClient("site-b", port));
    }
    const uint64_t target = last_committed + rounds_more(rng);
    if (target > 0) {
      ASSERT_TRUE(f.AwaitCommitted(target)) << "kill " << kill << ": round " << target;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(moment_ms(rng)));
    ::kill(server.pid(), SIGKILL);
    ASSERT_EQ(server.Wait(std::chrono::seconds(30)), 128 + SIGKILL) << "kill " << kill << ": killed while running";
    CheckAfterCrash(f, last_committed, kill);
    if (::testing::Test::HasFatalFailure()) return;
    progress.push_back(last_committed);
  }
  // Then left to finish: the sites reconnect on their own.
  ASSERT_EQ(f.StartServer(kRounds, 2, {}, listen), port);
  for (auto& client : clients) EXPECT_EQ(client->Wait(), 0);
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  CheckAfterCrash(f, last_committed, kKills + 1);
  EXPECT_EQ(last_committed, kRounds);
  EXPECT_GT(last_committed, 0u);
  std::printf("[   INFO   ] rounds committed at each of %d kills: %s; then all %llu\n", kKills,
              fmt::format("{}", fmt::join(progress, " ")).c_str(), static_cast<unsigned long long>(kRounds));
}

}  // namespace
}  // namespace estuary::testing
