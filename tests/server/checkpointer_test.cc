// Checkpointer: the model file and the strategy's state round-trip, and a
// checkpoint that disagrees with the round log is refused.
#include <gtest/gtest.h>

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
  auto checkpointer = Checkpointer::Open(dir / "checkpoints", task, std::nullopt);
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
                                                       {"update_kind", "full"}};
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
  auto checkpointer = Checkpointer::Open(dir.path(), task, std::nullopt);
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
  auto checkpointer = Checkpointer::Open(dir / "file" / "checkpoints", v1::TaskConfig(), std::nullopt);
  ASSERT_FALSE(checkpointer.ok());
  EXPECT_NE(checkpointer.status().message().find("cannot create checkpoint directory"), std::string::npos);
  EXPECT_NE(checkpointer.status().message().find((dir / "file" / "checkpoints").string()), std::string::npos);
}

}  // namespace
}  // namespace estuary::server
