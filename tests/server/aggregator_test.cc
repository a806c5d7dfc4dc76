// Aggregator: a round's work on the worker, run here on the test's thread:
// the new model, its checksum, its checkpoint and its score.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <numeric>

#include "crypto/sha256.h"
#include "crypto/transfer_digest.h"
#include "models/checkpoint.h"
#include "server/aggregator.h"
#include "server/config.h"
#include "server/recover.h"
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

// Folds a copy of `values`, which the aggregator's strategy may keep.
Result<std::string> Fold(Aggregator& aggregator, std::string_view client, std::vector<float> values,
                         uint64_t examples) {
  auto owned = std::make_shared<const std::vector<float>>(std::move(values));
  return aggregator.Fold(client, Layout(), owned, *owned, examples);
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

  std::unique_ptr<Aggregator> Make(std::unique_ptr<models::Evaluator> evaluator = nullptr,
                                   const v1::UpdateLimits& limits = {}, const std::string& strategy_name = "fedavg") {
    auto strategy = aggregation::MakeStrategy({.name = strategy_name});
    auto checkpointer = Checkpointer::Open(dir.path(), task(), std::nullopt, log);
    EXPECT_TRUE(strategy.ok() && checkpointer.ok());
    return std::make_unique<Aggregator>(std::move(strategy).value(), aggregation::UpdateBound(limits),
                                        std::move(evaluator), std::move(checkpointer).value(), Layout());
  }
  static v1::TaskConfig task() {
    v1::TaskConfig t;
    t.set_model("mlp");
    return t;
  }

  // After `aggregator` finished `round`: the round log commits it, so the
  // next Make is a restart that finds it.
  void Commit(Aggregator& aggregator, uint64_t round) {
    ASSERT_TRUE(aggregator.MarkCommitted(round).ok());
    std::ifstream marker(dir / "FEDERATION");
    std::string line;
    while (std::getline(marker, line)) {
      if (line.starts_with("federation_id ")) log.federation_id = line.substr(14);
    }
    log.last_committed = round;
  }

  testing::TempDir dir;
  Checkpointer::LogView log;  // the round log as the next Make finds it
  GlobalModel previous;
};

TEST_F(AggregatorTest, FinishWritesTheNewModelsCheckpointWhileTheEvaluatorScoresIt) {
  std::vector<float> scored;
  auto aggregator = Make(std::make_unique<RecordingEvaluator>(&scored));
  EXPECT_EQ(aggregator->name(), "fedavg");
  ASSERT_TRUE(aggregator->Begin(5, *previous.values, 2).ok());
  ASSERT_TRUE(Fold(*aggregator, "site-a", std::vector<float>(40, 1.0f), 1).ok());
  ASSERT_TRUE(Fold(*aggregator, "site-b", std::vector<float>(40, 3.0f), 1).ok());
  const Aggregator::Finished finished = aggregator->Finish(5, previous);
  ASSERT_TRUE(finished.status.ok()) << finished.status.ToString();

  std::vector<float> expected(40);
  std::iota(expected.begin(), expected.end(), 3.0f);  // 1, 2, ... plus the mean delta 2
  ASSERT_TRUE(finished.model.values);
  EXPECT_EQ(*finished.model.values, expected);
  EXPECT_EQ(finished.model.checksum, Checksum(expected));
  EXPECT_EQ(finished.model.digest, crypto::TransferDigestHex(expected.data(), expected.size() * sizeof(float)));
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

  // And once committed, it reads back at recovery, against the round log's checksum.
  Commit(*aggregator, 5);
  auto restored = Make()->Restore(finished.checkpoint, Checksum(expected));
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  EXPECT_EQ(*restored, expected);
}

// A robust rule keeps each staged update until Finish, through the owner the
// coordinator hands over (the staged file), and copies none of them; the
// update the bound scaled is kept as the bound's own copy. The median of
// three is the middle update, whatever the fold order.
TEST_F(AggregatorTest, ARobustRuleKeepsTheStagedUpdatesItIsGivenUntilFinish) {
  v1::UpdateLimits limits;
  limits.set_max_norm(100);
  auto aggregator = Make(nullptr, limits, "median");
  EXPECT_EQ(aggregator->name(), "median");
  ASSERT_TRUE(aggregator->Begin(5, *previous.values, 3).ok());
  std::vector<std::shared_ptr<const std::vector<float>>> staged;
  for (float v : {2.0f, -1.0f, 1e30f}) {
    staged.push_back(std::make_shared<const std::vector<float>>(40, v));
    auto folded = aggregator->Fold("site", Layout(), staged.back(), *staged.back(), 1);
    ASSERT_TRUE(folded.ok()) << folded.status().ToString();
  }
  EXPECT_EQ(staged[0].use_count(), 2) << "kept, not copied";
  EXPECT_EQ(staged[1].use_count(), 2);
  EXPECT_EQ(staged[2].use_count(), 1) << "scaled to the bound: the bound's copy is kept instead";
  const Aggregator::Finished finished = aggregator->Finish(5, previous);
  ASSERT_TRUE(finished.status.ok()) << finished.status.ToString();
  for (size_t i = 0; i < 40; ++i) EXPECT_EQ((*finished.model.values)[i], (*previous.values)[i] + 2.0f) << i;
  EXPECT_EQ(staged[0].use_count(), 1) << "released at Finish";
  EXPECT_EQ(staged[1].use_count(), 1);
}

// With limits: an update beyond the norm bound is folded scaled down to it
// (and says so), one claiming too many examples is refused with the strategy
// untouched, and the median that sets the next round's relative bound is
// saved in the checkpoint and restored with it.
TEST_F(AggregatorTest, UpdatesAreFoldedWithinTheFederationsLimits) {
  v1::UpdateLimits limits;
  limits.set_max_norm(10);
  limits.set_max_norm_over_median(2);
  limits.set_max_examples(100);
  auto aggregator = Make(nullptr, limits);
  ASSERT_TRUE(aggregator->Begin(5, *previous.values, 2).ok());
  auto honest = Fold(*aggregator, "site-a", std::vector<float>(40, 0.5f), 1);  // norm √40/2 ≈ 3.16
  ASSERT_TRUE(honest.ok()) << honest.status().ToString();
  EXPECT_EQ(*honest, "");
  auto poisoned = Fold(*aggregator, "site-b", std::vector<float>(40, 1e30f), 1);
  ASSERT_TRUE(poisoned.ok()) << poisoned.status().ToString();
  EXPECT_NE(poisoned->find("scaled down to the bound 10"), std::string::npos) << *poisoned;
  auto greedy = Fold(*aggregator, "site-c", std::vector<float>(40, 0.5f), 1ull << 40);
  ASSERT_FALSE(greedy.ok());
  EXPECT_NE(greedy.status().message().find("beyond the federation's max_examples of 100"), std::string::npos)
      << greedy.status().message();
  const Aggregator::Finished finished = aggregator->Finish(5, previous);
  ASSERT_TRUE(finished.status.ok()) << finished.status.ToString();
  // The mean of 0.5 and the poisoned delta scaled to norm 10 (each value 10/√40), weights 1 and 1.
  const double clipped = 10.0 / std::sqrt(40.0);
  for (size_t i = 0; i < 40; ++i) {
    EXPECT_NEAR((*finished.model.values)[i], (*previous.values)[i] + (0.5 + clipped) / 2, 1e-5) << i;
  }

  // The next round's relative bound is 2 × the median of this round's norms as folded (3.16 and the
  // poisoned one at 10: their mean 6.58), so 13.16; it is saved with the checkpoint, and a restarted
  // aggregator with only the relative bound bounds the next round there.
  limits.set_max_norm(0);
  Commit(*aggregator, 5);
  auto restarted = Make(nullptr, limits);
  ASSERT_TRUE(restarted->Restore(finished.checkpoint, finished.model.checksum).ok());
  ASSERT_TRUE(restarted->Begin(6, *finished.model.values, 2).ok());
  auto next = Fold(*restarted, "site-a", std::vector<float>(40, 1e31f), 1);
  ASSERT_TRUE(next.ok());
  EXPECT_NE(next->find("scaled down to the bound 13.16"), std::string::npos) << *next;
}

// SCAFFOLD through the aggregator, as the coordinator drives it: each
// update's Δc_i beside its delta; the model steps by the example-weighted
// mean delta and c by Σ Δc_i / N. c goes into the checkpoint beside the
// model, and an aggregator restarted from it goes on bit for bit with one
// that never stopped. Another strategy refuses a control delta, and
// SCAFFOLD an update without one.
TEST_F(AggregatorTest, ScaffoldFoldsEachSitesControlDeltaIntoCAndARestartContinuesBitForBit) {
  auto make = [&] {
    auto strategy = aggregation::MakeStrategy({.name = "scaffold", .server_lr = 1.0, .total_sites = 4});
    auto checkpointer = Checkpointer::Open(dir.path(), task(), std::nullopt, log);
    EXPECT_TRUE(strategy.ok() && checkpointer.ok());
    return std::make_unique<Aggregator>(std::move(strategy).value(), aggregation::UpdateBound(v1::UpdateLimits()),
                                        nullptr, std::move(checkpointer).value(), Layout());
  };
  auto fold = [](Aggregator& a, std::string_view client, float delta, const std::vector<float>& control_delta,
                 uint64_t examples) {
    auto owned = std::make_shared<const std::vector<float>>(40, delta);
    return a.Fold(client, Layout(), owned, *owned, examples, {}, control_delta);
  };
  std::vector<float> dc_a(40), dc_b(40);
  for (size_t i = 0; i < 40; ++i) {
    dc_a[i] = 0.25f * float(i) - 3.0f;
    dc_b[i] = 1.0f / float(i + 1);
  }
  auto fedavg = Make();
  ASSERT_TRUE(fedavg->Begin(5, *previous.values, 1).ok());
  auto not_taken = fold(*fedavg, "site-a", 1.0f, dc_a, 1);
  ASSERT_FALSE(not_taken.ok());
  EXPECT_NE(not_taken.status().message().find("carries a control delta, which fedavg does not take"),
            std::string::npos)
      << not_taken.status().message();
  auto fedavg_control = fedavg->Control();
  ASSERT_TRUE(fedavg_control.ok());
  EXPECT_EQ(*fedavg_control, nullptr);

  auto aggregator = make();
  auto zero = aggregator->Control();
  ASSERT_TRUE(zero.ok() && *zero);
  EXPECT_EQ(**zero, std::vector<float>(40, 0.0f)) << "c starts at zero";
  ASSERT_TRUE(aggregator->Begin(5, *previous.values, 2).ok());
  EXPECT_FALSE(fold(*aggregator, "site-x", 1.0f, {}, 1).ok()) << "no Δc";
  EXPECT_FALSE(fold(*aggregator, "site-x", 1.0f, std::vector<float>(39, 0.0f), 1).ok()) << "a Δc of another size";
  ASSERT_TRUE(fold(*aggregator, "site-a", 1.0f, dc_a, 1).ok());
  ASSERT_TRUE(fold(*aggregator, "site-b", 4.0f, dc_b, 2).ok());
  const Aggregator::Finished finished = aggregator->Finish(5, previous);
  ASSERT_TRUE(finished.status.ok()) << finished.status.ToString();
  std::vector<float> expected_c(40);
  for (size_t i = 0; i < 40; ++i) {
    EXPECT_EQ((*finished.model.values)[i], (*previous.values)[i] + 3.0f) << i;  // (1·1 + 4·2) / 3
    expected_c[i] = static_cast<float>(0.0 + 0.25 * (double(dc_a[i]) + double(dc_b[i])));
  }
  ASSERT_TRUE(finished.control);
  EXPECT_EQ(*finished.control, expected_c);
  EXPECT_TRUE(std::filesystem::exists(finished.checkpoint.string() + ".strategy")) << "c beside the model";

  Commit(*aggregator, 5);
  auto restarted = make();
  auto restored = restarted->Restore(finished.checkpoint, finished.model.checksum);
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  auto restored_c = restarted->Control();
  ASSERT_TRUE(restored_c.ok() && *restored_c);
  EXPECT_EQ(**restored_c, expected_c);
  std::vector<Aggregator::Finished> round_6;
  for (Aggregator* a : {aggregator.get(), restarted.get()}) {
    ASSERT_TRUE(a->Begin(6, *finished.model.values, 1).ok());
    ASSERT_TRUE(fold(*a, "site-b", -0.5f, dc_a, 3).ok());
    round_6.push_back(a->Finish(6, finished.model));
    ASSERT_TRUE(round_6.back().status.ok()) << round_6.back().status.ToString();
  }
  EXPECT_EQ(*round_6[1].model.values, *round_6[0].model.values);
  EXPECT_EQ(round_6[1].model.checksum, round_6[0].model.checksum);
  EXPECT_EQ(*round_6[1].control, *round_6[0].control);
  EXPECT_NE(*round_6[1].control, expected_c) << "round 6 moved c";
}

TEST_F(AggregatorTest, ARoundWithNothingFoldedFailsAndWritesNothing) {
  auto aggregator = Make();
  ASSERT_TRUE(aggregator->Begin(5, *previous.values, 2).ok());
  const Aggregator::Finished finished = aggregator->Finish(5, previous);
  EXPECT_FALSE(finished.status.ok());
  EXPECT_TRUE(finished.checkpoint.empty());
  EXPECT_FALSE(std::filesystem::exists(dir / "global-r00005.safetensors"));
}

// The server runs every robust rule; one that cannot defend a federation
// under DP noise is still refused there, in one line.
TEST(ServerConfig, TheServerTakesTheRobustStrategies) {
  for (const char* name : {"median", "trimmed-mean", "krum", "multi-krum", "bulyan"}) {
    ServerConfig config;
    config.federation.mutable_strategy()->set_name(name);
    EXPECT_TRUE(config.Finalize().ok()) << name << ": " << config.Finalize().ToString();
    config.federation.mutable_dp()->set_noise_multiplier(1.0);
    config.federation.mutable_dp()->set_clip(1.0);
    EXPECT_FALSE(config.Finalize().ok()) << name << " with DP";
  }
}

}  // namespace
}  // namespace estuary::server

namespace estuary::server {
namespace {

// FedNova's local work travels in UpdateBegin, and SCAFFOLD's control
// variates beside the model and the update, so the server takes both; what
// cannot carry them is refused in one line: secure aggregation (the server
// folds each site's Δc_i) and lora (c is over the model, a lora site trains
// adapters).
TEST(ServerConfig, TheServerTakesFedNovaAndScaffoldAndRefusesWhatCannotCarryTheirs) {
  ServerConfig config;
  config.federation.mutable_strategy()->set_name("fednova");
  EXPECT_TRUE(config.Finalize().ok()) << config.Finalize().ToString();
  config.secagg.on = true;  // a masked sum cannot be divided per site
  EXPECT_NE(config.Finalize().message().find("fednova"), std::string::npos) << config.Finalize().ToString();
  config.secagg.on = false;
  config.federation.mutable_strategy()->set_name("scaffold");
  EXPECT_NE(config.Finalize().message().find("total_sites"), std::string::npos) << config.Finalize().ToString();
  config.federation.mutable_strategy()->set_total_sites(10);
  EXPECT_TRUE(config.Finalize().ok()) << config.Finalize().ToString();
  // The same N under fedavg is refused unless Poisson-sampled DP-FedAvg divides by it.
  config.federation.mutable_strategy()->set_name("fedavg");
  EXPECT_NE(config.Finalize().message().find("config: total_sites = 10 with strategy fedavg"), std::string::npos)
      << config.Finalize().ToString();
  config.sample_rate = 0.5;
  config.federation.mutable_dp()->set_noise_multiplier(1);
  EXPECT_TRUE(config.Finalize().ok()) << config.Finalize().ToString();
  config.sample_rate = 0;
  config.federation.mutable_dp()->set_noise_multiplier(0);
  config.federation.mutable_strategy()->set_name("scaffold");
  config.secagg.on = true;
  const Status secagg = config.Finalize();
  EXPECT_NE(secagg.message().find("secagg with strategy scaffold: the server folds each site's control delta"),
            std::string::npos)
      << secagg.ToString();
  EXPECT_EQ(secagg.message().find('\n'), std::string::npos);
  config.secagg.on = false;
  config.federation.mutable_task()->set_update_kind(v1::UPDATE_LORA);
  const Status lora = config.Finalize();
  EXPECT_NE(lora.message().find("strategy = scaffold with update kind lora"), std::string::npos) << lora.ToString();
}

// The mode is sync or async (server/async_coordinator.h); anything else is one line.
TEST(ServerConfig, AcceptsSyncAndAsyncModesOnly) {
  ServerConfig config;
  EXPECT_TRUE(config.Finalize().ok());
  config.mode = "async";
  EXPECT_TRUE(config.Finalize().ok());
  config.mode = "buffered";
  EXPECT_EQ(config.Finalize().message(), "config: mode = 'buffered': expected sync or async");
}

// Distributed DP under Poisson sampling (sample_rate q, total_sites N): the
// server plans the run as estuary-sim does — shares for the expected q·N
// sites, room in the ring for PoissonPlannedMaximum(N, q), the mean over
// q·N — whatever the round drew, and refuses a draw the plan cannot hold.
TEST(ServerConfig, DistributedDpUnderPoissonSamplingIsPlannedForTheExpectedPopulation) {
  ServerConfig config;
  config.secagg.on = true;
  config.federation.mutable_limits()->set_max_norm_over_median(0);  // as serve --secagg sets it
  config.dp_mode = "distributed";
  config.federation.mutable_dp()->set_noise_multiplier(1);
  config.federation.mutable_dp()->set_clip(1);
  config.sample_rate = 0.1;
  Status missing = config.Finalize();
  EXPECT_NE(missing.message().find("config: sample_rate with dp_noise_multiplier needs total_sites"),
            std::string::npos)
      << missing.ToString();
  EXPECT_EQ(missing.message().find('\n'), std::string::npos);
  config.federation.mutable_strategy()->set_total_sites(1000);
  ASSERT_TRUE(config.Finalize().ok()) << config.Finalize().ToString();

  constexpr uint64_t kDimension = 199210;
  auto simulator = privacy::PlanDistributedDpShares(
      {.noise_multiplier = 1, .clip = 1, .survivors = 1, .denominator = 100, .expected_sites = 100, .max_sites = 158},
      32, 100, kDimension);
  ASSERT_TRUE(simulator.ok());
  for (uint32_t drawn : {90u, 100u, 158u}) {
    auto plan = DistributedDpPlanFor(config, drawn, kDimension);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    EXPECT_EQ(plan->scale, simulator->scale) << drawn;
    EXPECT_EQ(plan->site_variance, simulator->site_variance) << drawn;
    EXPECT_EQ(plan->min_included, 100u) << drawn;
    EXPECT_EQ(DistributedDpDenominator(config, drawn), 100) << drawn;
  }
  const privacy::DistributedDpPlan plan = *DistributedDpPlanFor(config, 100, kDimension);
  EXPECT_TRUE(DistributedDpDrawFits(config, 7, 100, plan).ok());
  EXPECT_TRUE(DistributedDpDrawFits(config, 7, 158, plan).ok());
  EXPECT_EQ(DistributedDpDrawFits(config, 7, 159, plan).message(),
            "secagg round 7: distributed DP: Poisson sampling drew 159 sites, more than the 158 the ring was planned "
            "for (q 0.1 of total_sites 1000): refusing the round");
  EXPECT_EQ(DistributedDpDrawFits(config, 7, 99, plan).message(),
            "secagg round 7: distributed DP: Poisson sampling drew 99 sites, fewer than the 100 inputs the noise is "
            "calibrated for (q 0.1 of total_sites 1000, --dp-survivors 1): refusing the round");
  // Without sampling the plan is the round's own, and any draw fits.
  config.sample_rate = 0;
  config.federation.mutable_strategy()->set_total_sites(0);
  ASSERT_TRUE(config.Finalize().ok()) << config.Finalize().ToString();
  EXPECT_EQ(DistributedDpPlanFor(config, 90, kDimension)->min_included, 90u);
  EXPECT_EQ(DistributedDpDenominator(config, 90), 90);
  EXPECT_TRUE(DistributedDpDrawFits(config, 7, 1000, plan).ok());
}

}  // namespace
}  // namespace estuary::server
