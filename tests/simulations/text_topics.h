// Three topics of distinct, learnable text in the layout of Debian's
// fortunes (one file per topic, documents ended by "%" lines), small enough
// for a test to pretrain and federate on: "cats", "numbers" and "plays".
#pragma once

#include <filesystem>
#include <fstream>

#include "tests/e2e/harness.h"

namespace estuary::simulations {

inline std::filesystem::path WriteTopics(const testing::TempDir& dir) {
  const auto root = dir / "fortunes";
  std::filesystem::create_directories(root);
  const char* lines[] = {"the cat sat on the mat and the cat was happy",
                         "one two three four five six seven eight nine ten",
                         "to be or not to be that is the question"};
  const char* names[] = {"cats", "numbers", "plays"};
  for (int t = 0; t < 3; ++t) {
    std::ofstream out(root / names[t]);
    for (int i = 0; i < 120; ++i) out << lines[t] << " " << i % 7 << "\n%\n";
  }
  return root;
}

}  // namespace estuary::simulations
