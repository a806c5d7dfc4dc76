// The server optimisers against PyTorch (torch_fedopt.py, which ctest runs
// first as a fixture and which writes one file per strategy into
// ESTUARY_FEDOPT_ORACLE_DIR): FedAdam against torch.optim.Adam, FedAdagrad
// against torch.optim.Adagrad, FedAvgM against torch.optim.SGD with momentum,
// FedYogi against Reddi et al.'s rule written out in torch.
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
    if (tag == "strategy") {
      line >> oracle.options.name;
    } else if (tag == "shape") {
      line >> oracle.parameters >> oracle.rounds >> oracle.clients;
    } else if (tag == "options") {
      double bias_correction = 0;
      line >> oracle.options.server_lr >> oracle.options.beta1 >> oracle.options.beta2 >> oracle.options.tau >>
          oracle.options.server_momentum >> bias_correction;
      oracle.options.bias_correction = bias_correction != 0;
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
  if (!ReadOracleFile(path, "estuary-fedopt-oracle 1", "torch_fedopt", read, error)) return false;
  if (oracle.parameters == 0 || oracle.after.size() != oracle.rounds || oracle.round_clients.size() != oracle.rounds) {
    error = path + ": incomplete oracle file";
    return false;
  }
  return true;
}

class FedOptOracle : public ::testing::TestWithParam<std::string> {};

TEST_P(FedOptOracle, EveryRoundMatchesTorch) {
  Oracle oracle;
  std::string error;
  ASSERT_TRUE(Load(std::string(ESTUARY_FEDOPT_ORACLE_DIR) + "/" + GetParam() + ".txt", oracle, error)) << error;
  ASSERT_EQ(oracle.options.name, GetParam());

  auto strategy = MakeStrategy(oracle.options);
  ASSERT_TRUE(strategy.ok()) << strategy.status().ToString();
  ASSERT_EQ((*strategy)->name(), GetParam());
  std::vector<float> x = oracle.x0;
  for (size_t round = 0; round < oracle.rounds; ++round) {
    ASSERT_TRUE((*strategy)->Begin(round, x).ok());
    for (const auto& [weight, delta] : oracle.round_clients[round]) {
      ASSERT_TRUE((*strategy)->Fold(delta, weight).ok());
    }
    ASSERT_TRUE((*strategy)->Finish(x).ok());

    // The model is stored in float after every round, torch's in double: a
    // parameter that passes near zero carries float's rounding of its larger
    // past, so each element is held to 1e-5 of itself and the largest error
    // to 1e-6 of the largest parameter.
    double worst = 0, largest_error = 0, largest = 0;
    size_t worst_index = 0;
    for (size_t i = 0; i < oracle.parameters; ++i) {
      const double expected = oracle.after[round][i];
      const double error = std::abs(x[i] - expected);
      if (error / std::abs(expected) > worst) worst = error / std::abs(expected), worst_index = i;
      largest_error = std::max(largest_error, error);
      largest = std::max(largest, std::abs(expected));
    }
    EXPECT_LE(worst, 1e-5) << GetParam() << " round " << round + 1 << ", parameter " << worst_index << ": estuary "
                           << x[worst_index] << ", torch " << oracle.after[round][worst_index];
    EXPECT_LE(largest_error / largest, 1e-6) << GetParam() << " round " << round + 1;
    // The update must actually have moved the model, or the comparison proves little.
    double moved = 0;
    for (size_t i = 0; i < oracle.parameters; ++i) moved = std::max(moved, std::abs(double(x[i]) - oracle.x0[i]));
    EXPECT_GT(moved, 0.01) << GetParam();
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, FedOptOracle,
                         ::testing::Values("fedadam", "fedadagrad", "fedavgm", "fedyogi"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace estuary::aggregation
