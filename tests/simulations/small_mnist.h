// The small MNIST federation several simulation tests run: 12 clients on
// McMahan's shards, 4 a round, 3 rounds of one epoch, seed 11 — on the
// synthetic digits testing::WriteSyntheticMnist writes to `data`.
#pragma once

#include <filesystem>

#include "simulations/runner.h"

namespace estuary::simulations {

inline Scenario Small(const std::filesystem::path& data, const std::filesystem::path& workdir) {
  Scenario s;
  s.clients = 12;
  s.per_round = 4;
  s.rounds = 3;
  s.task().set_epochs(1);
  s.task().set_batch_size(10);
  s.task().set_learning_rate(0.05f);
  s.partition = "shards";
  s.data_dir = data;
  s.workdir = workdir;
  s.task().set_seed(11);
  return s;
}

}  // namespace estuary::simulations
