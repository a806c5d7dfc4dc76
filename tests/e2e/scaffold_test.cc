// SCAFFOLD over the network: the real estuary-server and two estuary-client
// processes over mutual TLS on 127.0.0.1. The oracle is the same federation
// replayed in this process from the same flags, data and seed: both sites
// every round (two folds: their sum is the same in either order), each with
// its own client::SiteControl and the server's aggregation::Scaffold. The
// federation is stopped after round 2 — server and sites — and started again
// for rounds 3 and 4: the server must take c from its checkpoint and each
// site its c_i from its --state-dir, or round 3 departs from the replay.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>

#include <fstream>
#include <iterator>

#include "aggregation/federation.h"
#include "aggregation/federation_flags.h"
#include "aggregation/scaffold.h"
#include "client/compute.h"
#include "client/scaffold.h"
#include "client/site.h"
#include "crypto/sha256.h"
#include "models/dataset.h"
#include "tests/e2e/federation.h"

extern "C" void openblas_set_num_threads(int);

namespace estuary::testing {
namespace {

const std::vector<std::string> kFederationFlags = {"--strategy", "scaffold", "--total-sites", "3", "--epochs", "1",
                                                   "--batch", "10", "--lr", "0.05"};

struct Replay {
  std::vector<std::string> checksums;                    // the global model's after each round
  std::map<std::string, std::vector<float>> site_after;  // each site's c_i after round `c_i_after`
};

// `rounds` rounds of the federation the flags define, on `sites` (name, IDX
// directory) in name order; with `forget_at` > 0 every site forgets its c_i
// after that round (a site restarted without its state directory).
Replay RunInProcess(const std::vector<std::pair<std::string, fs::path>>& sites, const fs::path& eval_data,
                    uint64_t rounds, uint64_t c_i_after, uint64_t forget_at = 0) {
  Replay replay;
  v1::FederationConfig config = aggregation::DefaultFederation();
  CLI::App app;
  aggregation::AddFederationFlags(app, &config);
  std::vector<std::string> given(kFederationFlags.rbegin(), kFederationFlags.rend());
  app.parse(given);
  auto federation = aggregation::MakeFederation(config, {.data = eval_data, .threads = 1});
  EXPECT_TRUE(federation.ok()) << federation.status().ToString();
  if (!federation.ok()) return replay;
  auto& scaffold = dynamic_cast<aggregation::Scaffold&>(*federation->strategy);
  auto compute = client::ParseCompute("cpu", "fp32");
  EXPECT_TRUE(compute.ok());
  std::vector<std::unique_ptr<client::Trainer>> trainers;
  std::vector<client::SiteControl> controls(sites.size());
  for (const auto& [name, dir] : sites) {
    auto train = models::LoadIdx(dir, models::Split::kTrain);
    EXPECT_TRUE(train.ok()) << train.status().ToString();
    auto site = client::MakeLocalSite({.images = std::make_shared<const models::Dataset>(std::move(train).value())},
                                      {.compute = *compute});
    EXPECT_TRUE(site.ok()) << site.status().ToString();
    if (!site.ok()) return replay;
    trainers.push_back(std::move(site).value());
  }
  std::vector<float> global = federation->initial;
  const v1::TaskConfig& task = federation->config.task();
  for (uint64_t round = 1; round <= rounds; ++round) {
    auto control = scaffold.Control(global.size());
    EXPECT_TRUE(control.ok());
    federation->bound.BeginRound();
    federation->strategy->PlanRound(sites.size());
    EXPECT_TRUE(scaffold.Begin(round, global).ok());
    for (size_t i = 0; i < sites.size(); ++i) {
      auto update = controls[i].Train(*trainers[i], global, federation->manifest, task, round, sites[i].first, *control);
      EXPECT_TRUE(update.ok()) << update.status().ToString();
      if (!update.ok()) return replay;
      auto admitted = federation->bound.Admit(update->payload, update->num_examples);
      EXPECT_TRUE(admitted.ok()) << admitted.status().ToString();
      EXPECT_TRUE(scaffold
                      .FoldControl(sites[i].first, admitted->values(), update->control_delta,
                                   double(update->num_examples))
                      .ok());
    }
    EXPECT_TRUE(scaffold.Finish(global).ok());
    federation->bound.CommitRound();
    replay.checksums.push_back(crypto::Sha256Hex(global.data(), global.size() * sizeof(float)));
    if (round == c_i_after) {
      for (size_t i = 0; i < sites.size(); ++i) {
        replay.site_after[sites[i].first].assign(controls[i].value().begin(), controls[i].value().end());
      }
    }
    if (round == forget_at) {
      for (auto& c : controls) c = client::SiteControl();
    }
  }
  return replay;
}

std::vector<float> ReadFloats(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<float> values(bytes.size() / sizeof(float));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(float));
  return values;
}

TEST(Scaffold, OverTlsTheModelIsTheInProcessReplaysAndRestartsKeepCAndEachSitesCi) {
  openblas_set_num_threads(1);  // as estuary-client trains
  Federation f;
  f.Issue("site-a");
  f.Issue("site-b");
  const fs::path data_b = f.dir() / "data-b";
  WriteSyntheticMnist(data_b, 200, 50, 11);  // another site, other examples: the sites drift apart
  const std::vector<std::pair<std::string, fs::path>> sites = {{"site-a", f.data()}, {"site-b", data_b}};
  auto run = [&](uint64_t rounds) {
    const uint16_t port = f.StartServer(rounds, 2, kFederationFlags);
    std::vector<std::unique_ptr<ChildProcess>> clients;
    for (const auto& [name, data] : sites) {
      clients.push_back(f.StartClient(name, port, data,
                                      {"--eval-split", "0", "--state-dir", (f.dir() / ("state-" + name)).string()}));
    }
    for (size_t i = 0; i < clients.size(); ++i) EXPECT_EQ(clients[i]->Wait(), 0) << f.ClientLog(sites[i].first);
    ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  };
  run(2);
  const Replay replay = RunInProcess(sites, f.data(), 4, 2);
  ASSERT_EQ(replay.checksums.size(), 4u);
  // What each site keeps across the restart: its c_i after round 2, bit for bit.
  for (const auto& [name, data] : sites) {
    const fs::path file = f.dir() / ("state-" + name) / "scaffold-control.f32";
    ASSERT_TRUE(fs::exists(file)) << file;
    EXPECT_EQ(ReadFloats(file), replay.site_after.at(name)) << name;
  }
  EXPECT_TRUE(fs::exists(f.checkpoints() / "global-r00002.safetensors.strategy")) << "c goes beside the model";
  run(4);
  EXPECT_NE(f.ServerLog().find("resumed after round 2"), std::string::npos) << f.ServerLog();

  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 4u);
  for (size_t r = 0; r < 4; ++r) {
    SCOPED_TRACE(fmt::format("round {}", r + 1));
    EXPECT_EQ((*rounds)[r].global_checksum, replay.checksums[r]);
    EXPECT_EQ((*rounds)[r].updates_received, 2u);
    // c and Δc travel beside the model and the delta: twice FedAvg's bytes each way.
    for (auto& [name, p] : ParticipationsByName(*store, r + 1)) {
      EXPECT_EQ(p.status, "committed") << name;
      EXPECT_EQ(p.bytes_up, 2 * 4 * replay.site_after.begin()->second.size()) << name;
      EXPECT_EQ(p.bytes_down, 2 * 4 * replay.site_after.begin()->second.size()) << name;
    }
  }
  // The restart's part: a site that lost its c_i (or a server its c) would
  // have trained round 3 from zero, and the model would tell.
  const Replay forgetful = RunInProcess(sites, f.data(), 3, 0, 2);
  ASSERT_EQ(forgetful.checksums.size(), 3u);
  EXPECT_EQ(forgetful.checksums[1], replay.checksums[1]);
  EXPECT_NE(forgetful.checksums[2], replay.checksums[2]);
}

// What does not combine with SCAFFOLD is refused before the server listens,
// in one line that says why.
TEST(Scaffold, TheServerRefusesWhatDoesNotCombineInOneLine) {
  Federation f;
  const auto refused = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = f.ServeArgs(1, 2, extra);
    std::string line = BinaryPath("estuary-server").string();
    for (const auto& a : args) line += " '" + a + "'";
    return RunCommand(line + " 2>&1");
  };
  std::vector<std::string> secagg = kFederationFlags;
  secagg.push_back("--secagg");
  const CommandResult with_secagg = refused(secagg);
  EXPECT_NE(with_secagg.exit_code, 0);
  EXPECT_NE(with_secagg.output.find("secagg with strategy scaffold: the server folds each site's control delta"),
            std::string::npos)
      << with_secagg.output;
  std::vector<std::string> without_sites = {"--strategy", "scaffold"};
  const CommandResult no_n = refused(without_sites);
  EXPECT_NE(no_n.exit_code, 0);
  EXPECT_NE(no_n.output.find("total_sites"), std::string::npos) << no_n.output;
}

}  // namespace
}  // namespace estuary::testing
