// End-to-end: asynchronous rounds (serve --mode async, FedBuff) with the
// real estuary-server and three estuary-client processes over mutual TLS on
// 127.0.0.1, configured by a TOML file. The server commits the versions asked for and stops by itself,
// the sites with it; the round log, read through `rounds show --json`, holds
// every version's arrivals, each with the version it trained from, its
// staleness and its weight, and the weights follow the staleness rule exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tests/e2e/federation.h"
#include "tests/e2e/harness.h"

namespace estuary::testing {
namespace {

TEST(Async, SitesTrainContinuouslyAndEveryKUpdatesMakeAVersionWeightedByStaleness) {
  constexpr uint64_t kVersions = 4;
  constexpr uint64_t kBuffer = 2;
  Federation f;
  const std::vector<std::string> names = {"site-a", "site-b", "site-c"};
  for (const auto& name : names) f.Issue(name);
  // The TOML keys, as an operator's file has them.
  const fs::path config = f.dir() / "async.toml";
  std::ofstream(config) << fmt::format("mode = \"async\"\nbuffer = {}\nstaleness_weight = \"poly:0.5\"\n", kBuffer);
  const uint16_t port = f.StartServer(kVersions, 3, {"--config", config.string()});
  ASSERT_NE(port, 0);
  std::vector<std::unique_ptr<ChildProcess>> sites;
  for (const auto& name : names) sites.push_back(f.StartClient(name, port));
  for (size_t i = 0; i < sites.size(); ++i) {
    EXPECT_EQ(sites[i]->Wait(std::chrono::seconds(90)), 0) << f.ClientLog(names[i]) << "\n" << f.ServerLog();
  }
  EXPECT_EQ(f.WaitServer(), 0) << f.ServerLog();
  EXPECT_NE(f.ServerLog().find(fmt::format("federation complete after {} versions", kVersions)), std::string::npos)
      << f.ServerLog();

  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  EXPECT_EQ(*store->GetMeta("complete"), std::optional<std::string>(std::to_string(kVersions)));
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), kVersions) << "no version begun after the last";
  const std::string server_bin = BinaryPath("estuary-server").string();
  uint64_t stale_arrivals = 0;
  for (uint64_t version = 1; version <= kVersions; ++version) {
    const server::RoundRecord& r = (*rounds)[version - 1];
    EXPECT_EQ(r.state, server::RoundState::kCommitted) << version;
    EXPECT_EQ(r.model_version, version);
    EXPECT_EQ(r.strategy, "fedbuff");
    EXPECT_EQ(r.updates_received, kBuffer) << version;
    auto show = RunCommand(fmt::format("{} rounds show {} --db {} --json", server_bin, version, f.db().string()));
    ASSERT_EQ(show.exit_code, 0) << show.output;
    const auto doc = nlohmann::json::parse(show.output);
    EXPECT_EQ(doc["model_version"], version);
    uint64_t folded = 0;
    for (const auto& a : doc["arrivals"]) {
      const uint64_t from = a["trained_from"];
      const uint64_t staleness = a["staleness"];
      // The server was at version - 1 while it built this version.
      EXPECT_EQ(staleness, version - 1 - from) << a.dump();
      ASSERT_EQ(a["status"], "folded") << a.dump() << "\n" << f.ServerLog();
      EXPECT_EQ(double(a["weight"]), std::pow(1.0 + double(staleness), -0.5)) << a.dump();
      EXPECT_GT(uint64_t(a["examples"]), 0u);
      stale_arrivals += staleness > 0;
      ++folded;
    }
    EXPECT_EQ(folded, kBuffer) << doc.dump(2);
  }
  // All three began from version 0 and version 1 took two: the third arrived stale.
  EXPECT_GE(stale_arrivals, 1u);
  auto text = RunCommand(fmt::format("{} rounds show 2 --db {}", server_bin, f.db().string()));
  EXPECT_NE(text.output.find("arrivals (asynchronous"), std::string::npos) << text.output;
}

TEST(Async, TheServerRefusesWhatCannotRunAsynchronouslyInOneLine) {
  Federation f;
  auto run = RunCommand(fmt::format("{} serve --mode async --secagg --db {} --cert {} --key {} --ca {}",
                                    BinaryPath("estuary-server").string(), f.db().string(),
                                    f.Files("server").cert.string(), f.Files("server").key.string(),
                                    f.Files("server").ca.string()));
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("config: mode = async with secagg: secure aggregation masks one round's sum"),
            std::string::npos)
      << run.output;
}

}  // namespace
}  // namespace estuary::testing
