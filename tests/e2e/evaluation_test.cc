// Federated evaluation end to end: the real estuary-server and estuary-client
// binaries over mutual TLS on 127.0.0.1. The oracle: the global model each
// evaluated round committed (its checkpoint), scored here on the union of
// the sites' held-out examples, which the test takes from their data as the
// sites do; the example-weighted mean of the sites' scores must equal it.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <map>

#include "base/seed.h"
#include "client/held_out.h"
#include "models/checkpoint.h"
#include "models/dataset.h"
#include "models/model.h"
#include "tests/e2e/federation.h"

namespace estuary::testing {
namespace {

// The examples a site started with `--eval-split fraction --eval-seed seed` holds out.
models::Dataset HeldOut(const fs::path& data, double fraction, uint64_t seed) {
  auto train = models::LoadIdx(data, models::Split::kTrain);
  EXPECT_TRUE(train.ok()) << train.status().ToString();
  client::SiteData site{.images = std::make_shared<const models::Dataset>(std::move(train).value())};
  auto held = client::SplitHeldOut(&site, fraction, MixSeed(seed, std::string_view("held-out")));
  EXPECT_TRUE(held.ok() && held->images);
  return *held->images;
}

TEST(FederatedEvaluation, TheSitesScoreIsTheGlobalModelsOnTheUnionOfTheirHeldOutExamples) {
  Federation f;
  f.Issue("site-a");
  f.Issue("site-b");
  const fs::path data_b = f.dir() / "data-b";
  WriteSyntheticMnist(data_b, 200, 50, 11);
  const fs::path events_dir = f.dir() / "tensorboard";
  const uint16_t port = f.StartServer(3, 2, {"--evaluate-every", "2", "--tensorboard", events_dir.string()});
  auto a = f.StartClient("site-a", port, {}, {"--eval-split", "0.2", "--eval-seed", "5"});
  auto b = f.StartClient("site-b", port, data_b, {"--eval-split", "0.1"});
  EXPECT_EQ(a->Wait(), 0) << f.ClientLog("site-a");
  EXPECT_EQ(b->Wait(), 0) << f.ClientLog("site-b");
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();

  // The union of the held-out examples: 60 of site-a's 300, 20 of site-b's 200.
  models::Dataset pooled = HeldOut(f.data(), 0.2, 5);
  const models::Dataset b_held = HeldOut(data_b, 0.1, 0);
  ASSERT_EQ(pooled.size(), 60u);
  ASSERT_EQ(b_held.size(), 20u);
  pooled.features.insert(pooled.features.end(), b_held.features.begin(), b_held.features.end());
  pooled.labels.insert(pooled.labels.end(), b_held.labels.begin(), b_held.labels.end());

  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 3u);
  EXPECT_FALSE((*rounds)[0].evaluation.has_value()) << "round 1 is not due";
  // The held-out examples never train: each site announces the rest.
  auto participants = store->Participations(1);
  ASSERT_TRUE(participants.ok());
  ASSERT_EQ(participants->size(), 2u);
  EXPECT_EQ((*participants)[0].examples, 240u);
  EXPECT_EQ((*participants)[1].examples, 180u);
  for (uint64_t round : {2u, 3u}) {
    SCOPED_TRACE(fmt::format("round {}", round));
    const auto& evaluation = (*rounds)[round - 1].evaluation;
    ASSERT_TRUE(evaluation.has_value());
    EXPECT_EQ(evaluation->selected, 2u);
    EXPECT_EQ(evaluation->reported, 2u);
    EXPECT_EQ(evaluation->unsupported + evaluation->failed, 0u);
    EXPECT_EQ(evaluation->examples, 80u);
    auto path = store->CheckpointFor(round);
    ASSERT_TRUE(path.ok() && path->has_value());
    auto checkpoint = models::LoadCheckpoint(**path);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
    auto model = models::MakeModel("mlp");
    ASSERT_TRUE(model.ok());
    ASSERT_EQ(checkpoint->data.size(), (*model)->parameters().size());
    std::copy(checkpoint->data.begin(), checkpoint->data.end(), (*model)->parameters().begin());
    const models::EvalResult expected =
        models::Evaluate(**model, pooled.features.data(), pooled.labels.data(), pooled.size());
    EXPECT_NEAR(evaluation->loss, expected.loss, 1e-5 * expected.loss);
    ASSERT_TRUE(evaluation->accuracy.has_value());
    EXPECT_NEAR(*evaluation->accuracy, expected.accuracy, 1e-12);
  }
  EXPECT_GT(*(*rounds)[2].evaluation->accuracy, 0.3);  // a learnable problem: chance is 0.1

  // The operator's views.
  const std::string server = BinaryPath("estuary-server").string();
  const auto shown = RunCommand(fmt::format("{} rounds show 3 --db {} --json", server, f.db().string()));
  ASSERT_EQ(shown.exit_code, 0) << shown.output;
  const auto doc = nlohmann::json::parse(shown.output);
  EXPECT_EQ(doc["federated_evaluation"]["examples"], 80);
  EXPECT_EQ(doc["federated_evaluation"]["sites_reported"], 2);
  EXPECT_DOUBLE_EQ(doc["federated_evaluation"]["accuracy"].get<double>(), *(*rounds)[2].evaluation->accuracy);
  const auto listed = RunCommand(fmt::format("{} rounds list --db {}", server, f.db().string()));
  ASSERT_EQ(listed.exit_code, 0) << listed.output;
  EXPECT_NE(listed.output.find("fed acc"), std::string::npos) << listed.output;
  EXPECT_NE(f.ClientLog("site-a").find("60 examples held out of training"), std::string::npos) << f.ClientLog("site-a");

  // serve --tensorboard: the evaluated rounds' federated scalars, read by an
  // independent reader, as the round log has them (as float32).
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(events_dir)) files.push_back(entry.path());
  ASSERT_EQ(files.size(), 1u);
  auto read = RunCommand(
      fmt::format("{} {}/proto/read_tfevents.py {}", ESTUARY_PYTHON, ESTUARY_TESTS_DIR, files[0].string()));
  ASSERT_EQ(read.exit_code, 0) << read.output;
  const auto events = nlohmann::json::parse(read.output, nullptr, false);
  ASSERT_FALSE(events.is_discarded()) << read.output;
  std::map<uint64_t, nlohmann::json> federated;
  for (const auto& event : events["events"]) {
    if (event["scalars"].contains("federated/accuracy")) federated[event["step"].get<uint64_t>()] = event["scalars"];
  }
  ASSERT_EQ(federated.size(), 2u) << read.output;
  for (uint64_t round : {2u, 3u}) {
    const server::RoundEvaluation& e = *(*rounds)[round - 1].evaluation;
    ASSERT_TRUE(federated.count(round)) << read.output;
    EXPECT_EQ(federated[round]["federated/accuracy"].get<double>(), double(float(*e.accuracy)));
    EXPECT_EQ(federated[round]["federated/loss"].get<double>(), double(float(e.loss)));
    EXPECT_EQ(federated[round]["federated/examples"].get<double>(), 80.0);
  }
}

// A site that holds nothing out answers that it does not evaluate: counted
// apart, and the federation, its last evaluation included, completes.
TEST(FederatedEvaluation, ASiteThatDoesNotEvaluateIsCountedApart) {
  Federation f;
  f.Issue("site-a");
  f.Issue("site-b");
  const uint16_t port = f.StartServer(1, 2, {"--evaluate-every", "1"});
  auto a = f.StartClient("site-a", port, {}, {"--eval-split", "0"});
  auto b = f.StartClient("site-b", port);  // the default split
  EXPECT_EQ(a->Wait(), 0) << f.ClientLog("site-a");
  EXPECT_EQ(b->Wait(), 0) << f.ClientLog("site-b");
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto round = store->GetRound(1);
  ASSERT_TRUE(round.ok() && round->has_value() && (*round)->evaluation);
  const server::RoundEvaluation& e = *(*round)->evaluation;
  EXPECT_EQ(e.selected, 2u);
  EXPECT_EQ(e.reported, 1u);
  EXPECT_EQ(e.unsupported, 1u);
  EXPECT_EQ(e.examples, 30u);  // --eval-split 0.1 of 300
  EXPECT_NE(f.ClientLog("site-a").find("this site does not evaluate"), std::string::npos) << f.ClientLog("site-a");
}

}  // namespace
}  // namespace estuary::testing
