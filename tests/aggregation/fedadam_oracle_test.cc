// FedAdam with bias correction against torch.optim.Adam (see torch_fedadam.py,
// which ctest runs first as a fixture and which writes ESTUARY_FEDADAM_ORACLE).
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "aggregation/strategy.h"
#include "tests/aggregation/oracle_file.h"

namespace estuary::aggregation {
namespace {

struct Oracle {
  size_t parameters = 0, rounds = 0, clients = 0;
  StrategyOptions options;
  std::vector<float> x0;
  std::vector<std::vector<std::pair<double, std::vector<float>>>> round_clients;
  std::vector<std::vector<double>> after;
};

using testing::ReadOracleFile;
using testing::ReadValues;

bool Load(const std::string& path, Oracle& oracle, std::string& error) {
  auto read = [&](const std::string& tag, std::istringstream& line) {
    if (tag == "shape") {
      line >> oracle.parameters >> oracle.rounds >> oracle.clients;
    } else if (tag == "options") {
      oracle.options = {.name = "fedadam", .bias_correction = true};
      line >> oracle.options.server_lr >> oracle.options.beta1 >> oracle.options.beta2 >> oracle.options.tau;
    } else if (tag == "x0") {
      oracle.x0 = ReadValues<float>(line, oracle.parameters);
    } else if (tag == "client") {
      if (oracle.round_clients.size() == oracle.after.size()) oracle.round_clients.emplace_back();
      double weight = 0;
      line >> weight;
      oracle.round_clients.back().emplace_back(weight, ReadValues<float>(line, oracle.parameters));
    } else if (tag == "after") {
      oracle.after.push_back(ReadValues<double>(line, oracle.parameters));
    } else {
      return false;
    }
    return true;
  };
  if (!ReadOracleFile(path, "estuary-fedadam-oracle 1", "torch_fedadam", read, error)) return false;
  if (oracle.parameters == 0 || oracle.after.size() != oracle.rounds || oracle.round_clients.size() != oracle.rounds) {
    error = path + ": incomplete oracle file";
    return false;
  }
  return true;
}

TEST(FedAdamOracle, MatchesTorchAdam) {
  Oracle oracle;
  std::string error;
  ASSERT_TRUE(Load(ESTUARY_FEDADAM_ORACLE, oracle, error)) << error;

  auto strategy = MakeStrategy(oracle.options);
  ASSERT_TRUE(strategy.ok()) << strategy.status().ToString();
  std::vector<float> x = oracle.x0;
  for (size_t round = 0; round < oracle.rounds; ++round) {
    ASSERT_TRUE((*strategy)->Begin(round, x).ok());
    for (const auto& [weight, delta] : oracle.round_clients[round]) {
      ASSERT_TRUE((*strategy)->Fold(delta, weight).ok());
    }
    ASSERT_TRUE((*strategy)->Finish(x).ok());

    double worst = 0;
    size_t worst_index = 0;
    for (size_t i = 0; i < oracle.parameters; ++i) {
      const double expected = oracle.after[round][i];
      const double relative = std::abs(x[i] - expected) / std::abs(expected);
      if (relative > worst) worst = relative, worst_index = i;
    }
    EXPECT_LE(worst, 1e-5) << "round " << round + 1 << ", parameter " << worst_index << ": estuary "
                           << x[worst_index] << ", torch " << oracle.after[round][worst_index];
    // The update must actually have moved the model, or the comparison proves little.
    double moved = 0;
    for (size_t i = 0; i < oracle.parameters; ++i) moved = std::max(moved, std::abs(double(x[i]) - oracle.x0[i]));
    EXPECT_GT(moved, 0.01);
  }
}

}  // namespace
}  // namespace estuary::aggregation
