// estuary-sim --tensorboard DIR, run as a user runs it: one event file with a
// point per round, read by an independent reader (tests/proto/read_tfevents.py)
// and equal, as float32, to the rounds of the run's JSON report.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>

#include "tests/e2e/harness.h"

namespace estuary::testing {
namespace {

TEST(SimulationTensorBoard, EveryRoundIsPlottedAsTheReportHasIt) {
  TempDir dir;
  WriteSyntheticMnist(dir / "data", 600, 200, 3);
  const fs::path report = dir / "report.json", events_dir = dir / "tb";
  const auto run = RunCommand(fmt::format(
      "{} --quiet --data {} --clients 6 --per-round 3 --rounds 3 --epochs 1 --seed 5 --report {} --tensorboard {} "
      "--evaluate-every 3",
      BinaryPath("estuary-sim").string(), (dir / "data").string(), report.string(), events_dir.string()));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(events_dir)) files.push_back(entry.path());
  ASSERT_EQ(files.size(), 1u);
  const auto read =
      RunCommand(fmt::format("{} {}/proto/read_tfevents.py {}", ESTUARY_PYTHON, ESTUARY_TESTS_DIR, files[0].string()));
  ASSERT_EQ(read.exit_code, 0) << read.output;
  const auto events = nlohmann::json::parse(read.output, nullptr, false);
  ASSERT_FALSE(events.is_discarded()) << read.output;
  std::ifstream in(report);
  const auto doc = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(doc.is_discarded());
  const auto& rounds = doc["rounds"];
  ASSERT_EQ(rounds.size(), 3u);
  ASSERT_EQ(events["events"].size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const auto& scalars = events["events"][i]["scalars"];
    EXPECT_EQ(events["events"][i]["step"], rounds[i]["round"]);
    EXPECT_EQ(scalars["eval/accuracy"].get<double>(), double(float(rounds[i]["test_accuracy"].get<double>())));
    EXPECT_EQ(scalars["round/train_loss"].get<double>(), double(float(rounds[i]["train_loss"].get<double>())));
    EXPECT_EQ(scalars["round/updates_received"].get<double>(), 3.0);
    // --evaluate-every 3: the sites' federated evaluation of the last round only.
    EXPECT_EQ(scalars.contains("federated/accuracy"), i == 2);
    if (i == 2) {
      EXPECT_EQ(scalars["federated/accuracy"].get<double>(),
                double(float(rounds[i]["federated_accuracy"].get<double>())));
      EXPECT_EQ(scalars["federated/loss"].get<double>(), double(float(rounds[i]["federated_loss"].get<double>())));
    }
  }
}

}  // namespace
}  // namespace estuary::testing
