// Aggregator: a round's work on the worker, run here on the test's thread:
// the new model, its checksum, its checkpoint and its score.
#include <gtest/gtest.h>

#include <numeric>

#include "crypto/sha256.h"
#include "models/checkpoint.h"
#include "server/aggregator.h"
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

// Scores every model 0.75 and remembers the last one it saw.
class RecordingEvaluator final : public models::Evaluator {
 public:
  explicit RecordingEvaluator(std::vector<float>* seen) : seen_(seen) {}
  Result<models::EvalResult> Evaluate(std::span<const float> global) override {
    seen_->assign(global.begin(), global.end());
    return models::EvalResult{.loss = 0.25, .accuracy = 0.75, .examples = 8};
  }

 private:
  std::vector<float>* seen_;
};

class AggregatorTest : public ::testing::Test {
 protected:
  AggregatorTest() {
    std::vector<float> values(40);
    std::iota(values.begin(), values.end(), 1.0f);
    previous = {std::make_shared<const std::vector<float>>(values), Checksum(values), 4};
  }

  std::unique_ptr<Aggregator> Make(std::unique_ptr<models::Evaluator> evaluator = nullptr) {
    auto strategy = aggregation::MakeStrategy({});
    auto checkpointer = Checkpointer::Open(dir.path(), task(), std::nullopt);
    EXPECT_TRUE(strategy.ok() && checkpointer.ok());
    return std::make_unique<Aggregator>(std::move(strategy).value(), std::move(evaluator),
                                        std::move(checkpointer).value(), Layout());
  }
  static v1::TaskConfig task() {
    v1::TaskConfig t;
    t.set_model("mlp");
    return t;
  }

  testing::TempDir dir;
  GlobalModel previous;
};

TEST_F(AggregatorTest, FinishWritesTheNewModelsCheckpointWhileTheEvaluatorScoresIt) {
  std::vector<float> scored;
  auto aggregator = Make(std::make_unique<RecordingEvaluator>(&scored));
  EXPECT_EQ(aggregator->name(), "fedavg");
  ASSERT_TRUE(aggregator->Begin(5, *previous.values).ok());
  ASSERT_TRUE(aggregator->Fold("site-a", Layout(), std::vector<float>(40, 1.0f), 1).ok());
  ASSERT_TRUE(aggregator->Fold("site-b", Layout(), std::vector<float>(40, 3.0f), 1).ok());
  const Aggregator::Finished finished = aggregator->Finish(5, previous);
  ASSERT_TRUE(finished.status.ok()) << finished.status.ToString();

  std::vector<float> expected(40);
  std::iota(expected.begin(), expected.end(), 3.0f);  // 1, 2, ... plus the mean delta 2
  ASSERT_TRUE(finished.model.values);
  EXPECT_EQ(*finished.model.values, expected);
  EXPECT_EQ(finished.model.checksum, Checksum(expected));
  EXPECT_NE(finished.model.values, previous.values) << "a new model; the published one is left as it was";
  EXPECT_EQ((*previous.values)[0], 1.0f);
  EXPECT_EQ(scored, expected);
  ASSERT_TRUE(finished.eval.has_value());
  EXPECT_EQ(finished.eval->accuracy, 0.75);
  EXPECT_EQ(finished.checkpoint, dir / "global-r00005.safetensors");
  auto written = models::LoadCheckpoint(finished.checkpoint);
  ASSERT_TRUE(written.ok());
  EXPECT_EQ(written->data, expected);
  EXPECT_EQ(written->metadata["sha256"], Checksum(expected));

  // And it reads back at recovery, against the round log's checksum.
  auto restored = Make()->Restore(finished.checkpoint, Checksum(expected));
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  EXPECT_EQ(*restored, expected);
}

TEST_F(AggregatorTest, ARoundWithNothingFoldedFailsAndWritesNothing) {
  auto aggregator = Make();
  ASSERT_TRUE(aggregator->Begin(5, *previous.values).ok());
  const Aggregator::Finished finished = aggregator->Finish(5, previous);
  EXPECT_FALSE(finished.status.ok());
  EXPECT_TRUE(finished.checkpoint.empty());
  EXPECT_FALSE(std::filesystem::exists(dir / "global-r00005.safetensors"));
}

}  // namespace
}  // namespace estuary::server
