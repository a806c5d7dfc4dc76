// Checkpointer: the model file and the strategy's state round-trip, and a
// checkpoint that disagrees with the round log is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <numeric>

#include "crypto/sha256.h"
#include "models/checkpoint.h"
#include "server/checkpointer.h"
#include "tests/e2e/harness.h"

namespace estuary::server {
namespace {

// w [4, 8] at 0, b [8] at 32: 40 elements.
Manifest Layout() {
  Manifest m;
  m.Append("w", {4, 8});
  m.Append("b", {8});
  return m;
}

std::string Checksum(const std::vector<float>& values) {
  return crypto::Sha256Hex(values.data(), values.size() * sizeof(float));
}

// A FedAdam that has stepped once, so it has moments to keep.
std::unique_ptr<aggregation::Strategy> SteppedFedAdam(std::vector<float>& global) {
  auto strategy = aggregation::MakeStrategy({.name = "fedadam"});
  EXPECT_TRUE(strategy.ok());
  EXPECT_TRUE((*strategy)->Begin(1, global).ok());
  std::vector<float> delta(global.size());
  std::iota(delta.begin(), delta.end(), -20.0f);
  EXPECT_TRUE((*strategy)->Fold(delta, 3).ok());
  EXPECT_TRUE((*strategy)->Finish(global).ok());
  return std::move(strategy).value();
}

TEST(Checkpointer, TheModelAndTheStrategyStateRoundTrip) {
  testing::TempDir dir;
  v1::TaskConfig task;
  task.set_model("mlp");
  auto checkpointer = Checkpointer::Open(dir / "checkpoints", task, std::nullopt, {});
  ASSERT_TRUE(checkpointer.ok()) << checkpointer.status().ToString();
  EXPECT_TRUE(std::filesystem::is_directory(dir / "checkpoints"));

  std::vector<float> global(40);
  std::iota(global.begin(), global.end(), 1.0f);
  auto strategy = SteppedFedAdam(global);
  const auto saved_state = strategy->SaveState();
  ASSERT_FALSE(saved_state.empty());
  auto path = checkpointer->Write(3, Layout(), global, Checksum(global), strategy->name(), saved_state);
  ASSERT_TRUE(path.ok()) << path.status().ToString();
  EXPECT_EQ(*path, dir / "checkpoints" / "global-r00003.safetensors");
  EXPECT_TRUE(std::filesystem::exists(path->string() + ".strategy"));

  // What `estuary-server export` and other readers find in it.
  auto file = models::LoadCheckpoint(*path);
  ASSERT_TRUE(file.ok());
  const std::map<std::string, std::string> metadata = {{"round", "3"},
                                                       {"model", "mlp"},
                                                       {"sha256", Checksum(global)},
                                                       {"strategy", "fedadam"},
                                                       {"update_kind", "full"},
                                                       {"federation_id", checkpointer->federation_id()}};
  EXPECT_EQ(file->metadata, metadata);

  auto loaded = checkpointer->Load(*path, Layout(), Checksum(global));
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->values, global);
  EXPECT_EQ(loaded->state, saved_state);
}

TEST(Checkpointer, RefusesACheckpointThatDisagreesWithTheLogOrTheModel) {
  testing::TempDir dir;
  v1::TaskConfig task;
  task.set_model("mlp");
  auto checkpointer = Checkpointer::Open(dir.path(), task, std::nullopt, {});
  ASSERT_TRUE(checkpointer.ok());
  std::vector<float> global(40, 0.5f);
  auto fedavg = aggregation::MakeStrategy({});
  ASSERT_TRUE(fedavg.ok());
  auto path = checkpointer->Write(1, Layout(), global, Checksum(global), (*fedavg)->name(), (*fedavg)->SaveState());
  ASSERT_TRUE(path.ok());
  EXPECT_FALSE(std::filesystem::exists(path->string() + ".strategy")) << "fedavg keeps no state";

  const std::string logged(64, 'a');
  auto wrong_sum = checkpointer->Load(*path, Layout(), logged);
  ASSERT_FALSE(wrong_sum.ok());
  EXPECT_EQ(wrong_sum.status().message(),
            fmt::format("server: {}: checksum {} but the round log says {}", path->string(), Checksum(global), logged));

  Manifest other = Layout();
  other.tensors[1].name = "bias";
  auto wrong_model = checkpointer->Load(*path, other, Checksum(global));
  ASSERT_FALSE(wrong_model.ok());
  EXPECT_EQ(wrong_model.status().message(),
            fmt::format("server: {}: checkpoint does not match model 'mlp'", path->string()));
}

TEST(Checkpointer, ADirectoryThatCannotBeCreatedIsOneLineNamingIt) {
  testing::TempDir dir;
  std::ofstream(dir / "file") << "x";
  auto checkpointer = Checkpointer::Open(dir / "file" / "checkpoints", v1::TaskConfig(), std::nullopt, {});
  ASSERT_FALSE(checkpointer.ok());
  EXPECT_NE(checkpointer.status().message().find("cannot create checkpoint directory"), std::string::npos);
  EXPECT_NE(checkpointer.status().message().find((dir / "file" / "checkpoints").string()), std::string::npos);
}

// The checkpoint directory and the round log know each other.
class CheckpointDirectory : public ::testing::Test {
 protected:
  CheckpointDirectory() { task.set_model("mlp"); }
  Result<Checkpointer> Open(const Checkpointer::LogView& log) {
    return Checkpointer::Open(dir.path(), task, std::nullopt, log);
  }
  Checkpointer::LogView Log(std::optional<std::string> id, uint64_t last) {
    return {.path = "rounds.db", .federation_id = std::move(id), .last_committed = last};
  }
  // A federation whose log committed rounds 1..`rounds`, as the server leaves it.
  std::string Commit(uint64_t rounds) {
    auto checkpointer = Open(Log(std::nullopt, 0));
    EXPECT_TRUE(checkpointer.ok()) << checkpointer.status().ToString();
    EXPECT_TRUE(checkpointer->is_new());
    std::vector<float> global(40, 0.25f);
    for (uint64_t round = 1; round <= rounds; ++round) {
      EXPECT_TRUE(checkpointer->Write(round, Layout(), global, Checksum(global), "fedavg", {}).ok());
      EXPECT_TRUE(checkpointer->MarkCommitted(round).ok());
    }
    return checkpointer->federation_id();
  }
  std::string Marker() const {
    std::ifstream in(dir / "FEDERATION");
    return {std::istreambuf_iterator<char>(in), {}};
  }

  testing::TempDir dir;
  v1::TaskConfig task;
  std::vector<float> global = std::vector<float>(40, 0.25f);
};

TEST_F(CheckpointDirectory, ANewFederationGetsAnIdThatTheNextStartFinds) {
  const std::string id = Commit(2);
  EXPECT_EQ(id.size(), 32u);
  EXPECT_NE(Marker().find("federation_id " + id + "\nlast_committed_round 2\n"), std::string::npos) << Marker();
  auto reopened = Open(Log(id, 2));
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  EXPECT_FALSE(reopened->is_new());
  EXPECT_EQ(reopened->federation_id(), id);
  EXPECT_TRUE(reopened->removed().empty());
  testing::TempDir other;
  auto another = Checkpointer::Open(other.path(), task, std::nullopt, Log(std::nullopt, 0));
  ASSERT_TRUE(another.ok());
  EXPECT_NE(another->federation_id(), id);
}

TEST_F(CheckpointDirectory, ACommittedRoundsFileIsNeverWrittenAgain) {
  const std::string id = Commit(3);
  auto checkpointer = Open(Log(id, 3));
  ASSERT_TRUE(checkpointer.ok());
  for (uint64_t round : {1, 3}) {
    auto again = checkpointer->Write(round, Layout(), global, Checksum(global), "fedavg", {});
    ASSERT_FALSE(again.ok()) << round;
    EXPECT_NE(again.status().message().find("is committed; its checkpoint is never written again"),
              std::string::npos);
  }
  EXPECT_TRUE(checkpointer->Write(4, Layout(), global, Checksum(global), "fedavg", {}).ok());
}

TEST_F(CheckpointDirectory, AnEmptyOrMissingLogIsRefusedOverACommittedDirectory) {
  const std::string id = Commit(2);
  auto refused = Open(Log(std::nullopt, 0));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().message(),
            fmt::format("server: the round log rounds.db holds no federation, but {} holds federation {} committed "
                        "up to round 2: the log is missing, empty or truncated; restore it (with its -wal file), or "
                        "to start a new federation, give a new --db and an empty --checkpoint-dir",
                        dir.path().string(), id));
  EXPECT_TRUE(std::filesystem::exists(dir / "global-r00002.safetensors")) << "nothing is lost";
}

TEST_F(CheckpointDirectory, ALogThatLostCommittedRoundsIsRefused) {
  const std::string id = Commit(4);
  auto refused = Open(Log(id, 1));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("ends at round 1 but " + dir.path().string() +
                                            " says round 4 was committed: the log lost rounds 2..4"),
            std::string::npos)
      << refused.status().message();
  for (int round = 1; round <= 4; ++round) {
    EXPECT_TRUE(std::filesystem::exists(dir / fmt::format("global-r{:05}.safetensors", round)));
  }
}

TEST_F(CheckpointDirectory, AnotherFederationsLogOrDirectoryIsRefused) {
  const std::string id = Commit(1);
  auto other_log = Open(Log(std::string(32, 'a'), 1));
  ASSERT_FALSE(other_log.ok());
  EXPECT_NE(other_log.status().message().find("they belong to different federations"), std::string::npos);

  testing::TempDir empty;
  auto no_marker = Checkpointer::Open(empty.path(), task, std::nullopt, Log(id, 1));
  ASSERT_FALSE(no_marker.ok());
  EXPECT_NE(no_marker.status().message().find("has no FEDERATION file, but the round log rounds.db records "
                                              "federation " + id + " up to round 1"),
            std::string::npos)
      << no_marker.status().message();

  std::filesystem::remove(dir / "FEDERATION");
  auto unmarked = Open(Log(std::nullopt, 0));
  ASSERT_FALSE(unmarked.ok());
  EXPECT_NE(unmarked.status().message().find("holds checkpoints (global-r00001.safetensors) but no FEDERATION file"),
            std::string::npos)
      << unmarked.status().message();
}

TEST_F(CheckpointDirectory, LeftoversOfAKilledWriteOrAnUncommittedRoundAreRemoved) {
  const std::string id = Commit(3);
  // Round 4 written, and the server stopped before the log committed it;
  // or killed in the middle of a write.
  {
    auto checkpointer = Open(Log(id, 3));
    ASSERT_TRUE(checkpointer.ok());
    ASSERT_TRUE(checkpointer->Write(4, Layout(), global, Checksum(global), "fedavg", {}).ok());
  }
  std::ofstream(dir / ".global-r00004.safetensors.Ab12Cd") << "partial";
  std::ofstream(dir / ".FEDERATION.x9Y8z7") << "partial";
  std::ofstream(dir / "notes.txt") << "the operator's";
  auto reopened = Open(Log(id, 3));
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  std::vector<std::string> removed = reopened->removed();
  std::sort(removed.begin(), removed.end());
  EXPECT_EQ(removed, (std::vector<std::string>{".FEDERATION.x9Y8z7", ".global-r00004.safetensors.Ab12Cd",
                                               "global-r00004.safetensors"}));
  EXPECT_TRUE(std::filesystem::exists(dir / "global-r00003.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(dir / "notes.txt"));
}

TEST_F(CheckpointDirectory, AMarkerBehindTheLogIsBroughtForward) {
  const std::string id = Commit(2);
  {
    auto checkpointer = Open(Log(id, 2));
    ASSERT_TRUE(checkpointer.ok());
    ASSERT_TRUE(checkpointer->Write(3, Layout(), global, Checksum(global), "fedavg", {}).ok());
  }
  // The server stopped after the log committed round 3, before the marker.
  auto reopened = Open(Log(id, 3));
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  EXPECT_TRUE(reopened->removed().empty());
  EXPECT_NE(Marker().find("last_committed_round 3\n"), std::string::npos) << Marker();
}

TEST_F(CheckpointDirectory, ACheckpointOfAnotherFederationIsRefusedAtLoad) {
  Commit(1);
  testing::TempDir other_dir;
  auto other = Checkpointer::Open(other_dir.path(), task, std::nullopt, Log(std::nullopt, 0));
  ASSERT_TRUE(other.ok());
  auto loaded = other->Load(dir / "global-r00001.safetensors", Layout(), Checksum(global));
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("a checkpoint of federation"), std::string::npos);
}

TEST_F(CheckpointDirectory, AMalformedMarkerIsOneLineNamingItsLine) {
  std::ofstream(dir / "FEDERATION") << "# comment\nfederation_id xyz\n";
  auto refused = Open(Log(std::nullopt, 0));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().message(),
            fmt::format("server: {}:2: 'federation_id xyz' is not 'federation_id <32 hex digits>' or "
                        "'last_committed_round <n>'",
                        (dir / "FEDERATION").string()));
}

}  // namespace
}  // namespace estuary::server
