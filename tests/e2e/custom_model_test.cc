// A federation of a model the server knows only as a safetensors file
// (--initial-model), its sites written against the client API alone: the
// example site (examples/cpp-site, linear regression) as child processes,
// over real TLS on 127.0.0.1.
//
// The oracle: each site takes one full-batch gradient step on its mean
// squared error, and FedAvg weights the sites by their examples, so a round
// is exactly one step of gradient descent on all the sites' examples pooled.
// The test runs that in double precision and compares the server's global
// model, round after round's end, with it.
#include <gtest/gtest.h>

#include <fstream>
#include <random>

#include "models/checkpoint.h"
#include "models/custom_model.h"
#include "tests/e2e/federation.h"

namespace estuary::testing {
namespace {

constexpr int kFeatures = 3;

struct Example {
  double x[kFeatures];
  double y;
};

// Site k's examples, y = 2 x0 - x1 + 0.5 x2 + 1 plus noise, written as CSV.
std::vector<Example> WriteSiteData(const fs::path& path, int count, uint32_t seed) {
  std::mt19937 random(seed);
  std::normal_distribution<double> normal;
  std::vector<Example> examples(count);
  std::ofstream out(path);
  for (Example& e : examples) {
    for (double& x : e.x) x = normal(random);
    e.y = 2 * e.x[0] - e.x[1] + 0.5 * e.x[2] + 1 + 0.1 * normal(random);
    out << fmt::format("{:.17g},{:.17g},{:.17g},{:.17g}\n", e.x[0], e.x[1], e.x[2], e.y);
  }
  return examples;
}

// A Linear(3, 1) as torch names it, and (with `counter`) an integer buffer
// the federation holds and exports as it is.
models::CustomModel LinearModel(bool counter) {
  models::CustomModel model;
  model.layout = {{"linear.weight", {1, kFeatures}, "F32"}, {"linear.bias", {1}, "F32"}};
  model.manifest.Append("linear.weight", {1, kFeatures});
  model.manifest.Append("linear.bias", {1});
  model.values = {0.5f, -0.25f, 0.125f, 0.2f};
  if (counter) {
    model.layout.push_back({"linear.num_updates", {}, "I64"});
    const int64_t count = 1234567890123;
    model.held["linear.num_updates"] = std::string(reinterpret_cast<const char*>(&count), sizeof count);
  }
  model.name = models::CustomModelName(model.layout);
  return model;
}

std::unique_ptr<ChildProcess> StartSite(Federation& f, const std::string& name, uint16_t port, const fs::path& data,
                                        bool check_model, bool delta = false, const fs::path& eval_data = {}) {
  const auto files = f.Files(name);
  std::vector<std::string> argv = {fs::path(ESTUARY_BINARY_DIR) / "examples" / "linreg-site", "--server",
                                   fmt::format("127.0.0.1:{}", port), "--ca", files.ca.string(), "--cert",
                                   files.cert.string(), "--key", files.key.string(), "--data", data.string(),
                                   "--max-backoff", "1"};
  if (check_model) argv.push_back("--check-model");
  if (delta) argv.push_back("--delta");
  if (!eval_data.empty()) argv.insert(argv.end(), {"--eval-data", eval_data.string()});
  return std::make_unique<ChildProcess>(argv, f.dir() / (name + ".log"));
}

std::vector<std::string> ServeFlags(const fs::path& initial, double lr) {
  return {"--initial-model", initial.string(), "--epochs", "1", "--lr", fmt::format("{}", lr),
          "--round-deadline", "60"};
}

TEST(CustomModelFederation, FedAvgOfClientApiSitesIsGradientDescentOnTheirPooledData) {
  Federation f;
  f.eval_data = false;
  const models::CustomModel initial = LinearModel(/*counter=*/true);
  const fs::path model_file = f.dir() / "linear.safetensors";
  ASSERT_TRUE(models::SaveCustomModel(model_file, initial).ok());

  const int counts[] = {20, 50, 30};  // unequal: the weighting by examples matters
  std::vector<Example> pooled;
  std::vector<fs::path> data;
  for (int k = 0; k < 3; ++k) {
    data.push_back(f.dir() / fmt::format("site-{}.csv", k));
    const auto examples = WriteSiteData(data.back(), counts[k], 100 + k);
    pooled.insert(pooled.end(), examples.begin(), examples.end());
    f.Issue(fmt::format("site-{}", k));
  }
  constexpr uint64_t kRounds = 4;
  constexpr double kLr = 0.1;
  const uint16_t port = f.StartServer(kRounds, 3, ServeFlags(model_file, kLr));
  std::vector<std::unique_ptr<ChildProcess>> sites;
  // Site 1 returns its delta, the others their weights: the same update.
  for (int k = 0; k < 3; ++k) sites.push_back(StartSite(f, fmt::format("site-{}", k), port, data[k], false, k == 1));
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(sites[k]->Wait(), 0) << f.ClientLog(fmt::format("site-{}", k));
    EXPECT_NE(f.ClientLog(fmt::format("site-{}", k)).find(fmt::format("trained {} rounds", kRounds)),
              std::string::npos);
  }
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  EXPECT_NE(f.ServerLog().find("reports no server-side accuracy"), std::string::npos) << f.ServerLog();

  // Gradient descent on the pooled examples, in double.
  std::vector<double> w(initial.values.begin(), initial.values.end());  // 3 weights, then the bias
  const double n = double(pooled.size());
  for (uint64_t round = 0; round < kRounds; ++round) {
    double grad[kFeatures + 1] = {};
    for (const Example& e : pooled) {
      double error = w[kFeatures] - e.y;
      for (int j = 0; j < kFeatures; ++j) error += w[j] * e.x[j];
      for (int j = 0; j < kFeatures; ++j) grad[j] += 2 * error * e.x[j] / n;
      grad[kFeatures] += 2 * error / n;
    }
    for (int j = 0; j <= kFeatures; ++j) w[j] -= kLr * grad[j];
  }

  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto model_name = store->GetMeta("model");
  ASSERT_TRUE(model_name.ok() && model_name->has_value());
  EXPECT_EQ(**model_name, initial.name);
  auto last = store->LastCommittedRound();
  ASSERT_TRUE(last.ok() && last->has_value());
  EXPECT_EQ((*last)->round, kRounds);
  auto path = store->CheckpointFor(kRounds);
  ASSERT_TRUE(path.ok() && path->has_value());
  auto checkpoint = models::LoadCheckpoint(**path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  ASSERT_EQ(checkpoint->data.size(), 4u);
  for (int j = 0; j <= kFeatures; ++j) {
    // fp32 weights and updates: rounding of a few ulps a round.
    EXPECT_NEAR(checkpoint->data[j], w[j], 1e-5 * std::max(1.0, std::abs(w[j]))) << "parameter " << j;
    EXPECT_GT(std::abs(checkpoint->data[j] - initial.values[j]), 1e-3) << "parameter " << j << " never moved";
  }

  // The export: the initial file's names, shapes and dtypes; the round's
  // weights; the integer buffer as the file had it.
  const fs::path out = f.dir() / "export";
  const auto exported = RunCommand(fmt::format("{} export --db {} --out {}", BinaryPath("estuary-server").string(),
                                               f.db().string(), out.string()));
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  auto back = models::LoadCustomModel(out / "model.safetensors");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->name, initial.name);
  ASSERT_EQ(back->layout.size(), initial.layout.size());
  for (size_t i = 0; i < initial.layout.size(); ++i) {
    EXPECT_EQ(back->layout[i].name, initial.layout[i].name);
    EXPECT_EQ(back->layout[i].shape, initial.layout[i].shape);
    EXPECT_EQ(back->layout[i].dtype, initial.layout[i].dtype);
  }
  EXPECT_EQ(back->values, checkpoint->data);
  EXPECT_EQ(back->held, initial.held);
}

// Federated evaluation through the client API (Trainer::Evaluate): one site
// scores each round's model on its held-out examples, one has none (the
// default Evaluate: not supported), one's evaluation throws (its held-out
// examples are of another width). Only the first counts, as its mean squared
// error, which the test computes from the round's checkpoint; the other two
// are counted apart and hold nothing up.
TEST(CustomModelFederation, ClientApiSitesEvaluateAndThoseThatCannotDoNotHoldItUp) {
  Federation f;
  f.eval_data = false;
  const models::CustomModel initial = LinearModel(/*counter=*/false);
  const fs::path model_file = f.dir() / "linear.safetensors";
  ASSERT_TRUE(models::SaveCustomModel(model_file, initial).ok());
  std::vector<fs::path> data;
  for (int k = 0; k < 3; ++k) {
    data.push_back(f.dir() / fmt::format("site-{}.csv", k));
    WriteSiteData(data.back(), 20 + 10 * k, 200 + k);
    f.Issue(fmt::format("site-{}", k));
  }
  const fs::path held_out = f.dir() / "held-out.csv", narrow = f.dir() / "narrow.csv";
  const std::vector<Example> examples = WriteSiteData(held_out, 16, 300);
  {
    std::ofstream out(narrow);
    out << "1,2,3\n4,5,6\n";  // two features and y: not the model's three
  }
  constexpr uint64_t kRounds = 2;
  std::vector<std::string> flags = ServeFlags(model_file, 0.1);
  flags.insert(flags.end(), {"--evaluate-every", "1"});
  const uint16_t port = f.StartServer(kRounds, 3, flags);
  std::vector<std::unique_ptr<ChildProcess>> sites;
  sites.push_back(StartSite(f, "site-0", port, data[0], false, false, held_out));
  sites.push_back(StartSite(f, "site-1", port, data[1], false));
  sites.push_back(StartSite(f, "site-2", port, data[2], false, false, narrow));
  for (int k = 0; k < 3; ++k) EXPECT_EQ(sites[k]->Wait(), 0) << f.ClientLog(fmt::format("site-{}", k));
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  EXPECT_NE(f.ClientLog("site-2").find("the trainer's evaluation threw"), std::string::npos) << f.ClientLog("site-2");

  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  for (uint64_t round = 1; round <= kRounds; ++round) {
    SCOPED_TRACE(fmt::format("round {}", round));
    auto record = store->GetRound(round);
    ASSERT_TRUE(record.ok() && record->has_value() && (*record)->evaluation);
    const server::RoundEvaluation& e = *(*record)->evaluation;
    EXPECT_EQ(e.selected, 3u);
    EXPECT_EQ(e.reported, 1u);
    EXPECT_EQ(e.unsupported, 1u);
    EXPECT_EQ(e.failed, 1u);
    EXPECT_EQ(e.examples, examples.size());
    EXPECT_FALSE(e.accuracy.has_value()) << "a regression has no accuracy";
    auto path = store->CheckpointFor(round);
    ASSERT_TRUE(path.ok() && path->has_value());
    auto checkpoint = models::LoadCheckpoint(**path);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
    double mse = 0;
    for (const Example& x : examples) {
      double error = double(checkpoint->data[kFeatures]) - x.y;
      for (int j = 0; j < kFeatures; ++j) error += double(checkpoint->data[j]) * x.x[j];
      mse += error * error / double(examples.size());
    }
    EXPECT_NEAR(e.loss, mse, 1e-12 * std::max(1.0, mse));
  }
}

TEST(CustomModelFederation, ASiteRefusesAFederationOfAnotherModelInOneLine) {
  Federation f;
  f.eval_data = false;
  f.exit_when_done = false;  // the round never completes: the test stops the server
  // The server's file holds an integer buffer the site's model lacks.
  const models::CustomModel initial = LinearModel(/*counter=*/true);
  const std::string site_model = LinearModel(/*counter=*/false).name;
  ASSERT_NE(initial.name, site_model);
  const fs::path model_file = f.dir() / "linear.safetensors";
  ASSERT_TRUE(models::SaveCustomModel(model_file, initial).ok());
  f.Issue("site-0");
  const fs::path data = f.dir() / "site-0.csv";
  WriteSiteData(data, 10, 1);
  const uint16_t port = f.StartServer(1, 1, ServeFlags(model_file, 0.1));
  auto site = StartSite(f, "site-0", port, data, true);
  EXPECT_EQ(site->Wait(), 1) << f.ClientLog("site-0");
  const std::string line = fmt::format("refused round 1: the federation trains {}, this site's model is {}",
                                       initial.name, site_model);
  EXPECT_NE(f.ClientLog("site-0").find(line), std::string::npos) << f.ClientLog("site-0");
  EXPECT_TRUE(f.AwaitLog(line)) << f.ServerLog();
  f.server().Kill();
}

TEST(CustomModelFederation, ASiteOfTheSameModelTrainsIt) {
  Federation f;
  f.eval_data = false;
  const models::CustomModel initial = LinearModel(/*counter=*/false);
  const fs::path model_file = f.dir() / "linear.safetensors";
  ASSERT_TRUE(models::SaveCustomModel(model_file, initial).ok());
  f.Issue("site-0");
  const fs::path data = f.dir() / "site-0.csv";
  WriteSiteData(data, 10, 1);
  const uint16_t port = f.StartServer(1, 1, ServeFlags(model_file, 0.1));
  auto site = StartSite(f, "site-0", port, data, true);
  EXPECT_EQ(site->Wait(), 0) << f.ClientLog("site-0");
  EXPECT_EQ(f.WaitServer(), 0) << f.ServerLog();
  EXPECT_NE(f.ServerLog().find("model " + initial.name), std::string::npos) << f.ServerLog();
}

TEST(CustomModelFederation, ARestartedServerResumesItAndExportsEachRound) {
  Federation f;
  f.eval_data = false;
  const models::CustomModel initial = LinearModel(/*counter=*/true);
  const fs::path model_file = f.dir() / "linear.safetensors";
  ASSERT_TRUE(models::SaveCustomModel(model_file, initial).ok());
  f.Issue("site-0");
  const fs::path data = f.dir() / "site-0.csv";
  WriteSiteData(data, 10, 1);
  for (uint64_t rounds : {1, 2}) {  // the second server resumes the first's federation from its checkpoint
    const uint16_t port = f.StartServer(rounds, 1, ServeFlags(model_file, 0.1));
    auto site = StartSite(f, "site-0", port, data, false);
    EXPECT_EQ(site->Wait(), 0) << f.ClientLog("site-0");
    ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  }
  EXPECT_NE(f.ServerLog().find("resumed after round 1"), std::string::npos) << f.ServerLog();
  std::vector<std::vector<float>> exported;
  for (int round : {1, 2}) {
    const fs::path out = f.dir() / fmt::format("export-{}", round);
    const auto run = RunCommand(fmt::format("{} export --db {} --round {} --out {}",
                                            BinaryPath("estuary-server").string(), f.db().string(), round,
                                            out.string()));
    ASSERT_EQ(run.exit_code, 0) << run.output;
    auto back = models::LoadCustomModel(out / "model.safetensors");
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->name, initial.name);
    EXPECT_EQ(back->held, initial.held);
    exported.push_back(back->values);
  }
  EXPECT_NE(exported[0], exported[1]);
  EXPECT_NE(exported[0], initial.values);
}

TEST(CustomModelFederation, TheServerRefusesEvaluationDataAndBadFilesInOneLine) {
  Federation f;
  const fs::path model_file = f.dir() / "linear.safetensors";
  ASSERT_TRUE(models::SaveCustomModel(model_file, LinearModel(false)).ok());
  const fs::path bad = f.dir() / "bad.safetensors";
  std::ofstream(bad, std::ios::binary) << "not a safetensors file";
  const std::string server = BinaryPath("estuary-server").string();
  const std::string common = fmt::format("serve --listen 127.0.0.1:0 --cert {} --key {} --ca {} --db {}",
                                         f.Files("server").cert.string(), f.Files("server").key.string(),
                                         f.Files("server").ca.string(), f.db().string());
  const auto with_eval = RunCommand(fmt::format("{} {} --initial-model {} --eval-data {}", server, common,
                                                model_file.string(), f.data().string()));
  EXPECT_NE(with_eval.exit_code, 0);
  EXPECT_NE(with_eval.output.find("is a model the server knows only as tensors; it has no evaluator"),
            std::string::npos)
      << with_eval.output;
  const auto bad_file = RunCommand(fmt::format("{} {} --initial-model {}", server, common, bad.string()));
  EXPECT_NE(bad_file.exit_code, 0);
  EXPECT_NE(bad_file.output.find(fmt::format("initial_model = {}: header length", bad.string())), std::string::npos)
      << bad_file.output;
  const auto lora = RunCommand(fmt::format("{} {} --initial-model {} --update-kind lora", server, common,
                                           model_file.string()));
  EXPECT_NE(lora.exit_code, 0);
  EXPECT_NE(lora.output.find("with update_kind = lora: a model known only as a file trains full updates"),
            std::string::npos)
      << lora.output;
}

}  // namespace
}  // namespace estuary::testing
