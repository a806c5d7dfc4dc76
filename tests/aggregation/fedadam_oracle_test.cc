// FedAdam with bias correction against torch.optim.Adam (see torch_fedadam.py,
// which ctest runs first as a fixture and which writes ESTUARY_FEDADAM_ORACLE).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "aggregation/strategy.h"

namespace estuary::aggregation {
namespace {

struct Oracle {
  size_t parameters = 0, rounds = 0, clients = 0;
  StrategyOptions options;
  std::vector<float> x0;
  std::vector<std::vector<std::pair<double, std::vector<float>>>> round_clients;
  std::vector<std::vector<double>> after;
};

std::vector<double> ReadValues(std::istringstream& line, size_t count) {
  std::vector<double> values(count);
  for (double& v : values) line >> v;
  return values;
}

std::vector<float> ToFloat(const std::vector<double>& values) { return {values.begin(), values.end()}; }

bool Load(const std::string& path, Oracle& oracle, std::string& error) {
  std::ifstream in(path);
  if (!in) {
    error = path + ": cannot open; run via ctest so the torch_fedadam fixture writes it";
    return false;
  }
  std::string text, tag;
  std::getline(in, text);
  if (text != "estuary-fedadam-oracle 1") {
    error = path + ": bad header '" + text + "'";
    return false;
  }
  while (std::getline(in, text)) {
    std::istringstream line(text);
    line >> tag;
    if (tag == "shape") {
      line >> oracle.parameters >> oracle.rounds >> oracle.clients;
    } else if (tag == "options") {
      oracle.options = {.name = "fedadam", .bias_correction = true};
      line >> oracle.options.server_lr >> oracle.options.beta1 >> oracle.options.beta2 >> oracle.options.tau;
    } else if (tag == "x0") {
      oracle.x0 = ToFloat(ReadValues(line, oracle.parameters));
    } else if (tag == "client") {
      if (oracle.round_clients.size() == oracle.after.size()) oracle.round_clients.emplace_back();
      double weight = 0;
      line >> weight;
      oracle.round_clients.back().emplace_back(weight, ToFloat(ReadValues(line, oracle.parameters)));
    } else if (tag == "after") {
      oracle.after.push_back(ReadValues(line, oracle.parameters));
    } else {
      error = path + ": unknown line tag '" + tag + "'";
      return false;
    }
    if (line.fail()) {
      error = path + ": malformed '" + tag + "' line";
      return false;
    }
  }
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
