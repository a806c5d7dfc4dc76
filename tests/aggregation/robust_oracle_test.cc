// The robust rules against numpy_robust.py (each rule transcribed in NumPy
// from its paper), which ctest runs first as a fixture and which writes
// ESTUARY_ROBUST_ORACLE. Median, trimmed mean and the Krum and Bulyan
// selections must match exactly; scores and means to 1e-6 relative.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "aggregation/robust.h"
#include "tests/aggregation/oracle_file.h"

namespace estuary::aggregation {
namespace {

using testing::ReadOracleFile;
using testing::ReadValues;

struct Case {
  size_t n = 0, d = 0, f = 0;
  double beta = 0;
  std::vector<std::vector<float>> updates;
  std::vector<float> median, trimmed, multikrum, bulyan;
  std::vector<double> krum_scores;
  std::vector<size_t> krum_select, bulyan_select;
};

bool Load(const std::string& path, std::vector<Case>& cases, std::string& error) {
  auto read = [&](const std::string& tag, std::istringstream& line) {
    if (tag == "case") {
      Case c;
      line >> c.n >> c.d >> c.f >> c.beta;
      cases.push_back(std::move(c));
      return true;
    }
    if (cases.empty()) return false;
    Case& c = cases.back();
    if (tag == "update") {
      c.updates.push_back(ReadValues<float>(line, c.d));
    } else if (tag == "median") {
      c.median = ReadValues<float>(line, c.d);
    } else if (tag == "trimmed") {
      c.trimmed = ReadValues<float>(line, c.d);
    } else if (tag == "krum_scores") {
      c.krum_scores = ReadValues<double>(line, c.n);
    } else if (tag == "krum_select") {
      c.krum_select = ReadValues<size_t>(line, c.n);
    } else if (tag == "multikrum") {
      c.multikrum = ReadValues<float>(line, c.d);
    } else if (tag == "bulyan_select") {
      c.bulyan_select = ReadValues<size_t>(line, c.n - 2 * c.f);
    } else if (tag == "bulyan") {
      c.bulyan = ReadValues<float>(line, c.d);
    } else {
      return false;
    }
    return true;
  };
  if (!ReadOracleFile(path, "estuary-robust-oracle 1", "numpy_robust", read, error)) return false;
  for (const Case& c : cases) {
    if (c.updates.size() != c.n || c.bulyan.empty()) {
      error = path + ": incomplete case";
      return false;
    }
  }
  return !cases.empty();
}

std::vector<Case> LoadOrFail() {
  std::vector<Case> cases;
  std::string error;
  EXPECT_TRUE(Load(ESTUARY_ROBUST_ORACLE, cases, error)) << error;
  return cases;
}

KeptUpdates SourceOf(const Case& c) {
  KeptUpdates source(c.d);
  for (const auto& u : c.updates) EXPECT_TRUE(source.Add(u).ok());
  return source;
}

void ExpectNear(std::span<const float> got, std::span<const float> want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t j = 0; j < got.size(); ++j) {
    EXPECT_LE(std::abs(got[j] - want[j]), 1e-6 * std::max(1.0f, std::abs(want[j]))) << what << " [" << j << "]";
  }
}

// Blocks smaller than an update and not dividing it: the block-by-block pass
// must give what one block does.
constexpr size_t kBlocks[] = {kDefaultBlock, 7};

TEST(RobustOracleTest, MedianAndTrimmedMeanMatchNumpyExactly) {
  for (const Case& c : LoadOrFail()) {
    const KeptUpdates source = SourceOf(c);
    for (size_t block : kBlocks) {
      std::vector<float> out(c.d);
      ASSERT_TRUE(CoordinateMedian(source, out, block).ok());
      EXPECT_EQ(out, c.median) << "n = " << c.n << ", block " << block;
      ASSERT_TRUE(TrimmedMean(source, c.beta, out, block).ok());
      EXPECT_EQ(out, c.trimmed) << "n = " << c.n << ", beta " << c.beta << ", block " << block;
    }
  }
}

TEST(RobustOracleTest, KrumScoresSelectionAndMultiKrumMatchNumpy) {
  for (const Case& c : LoadOrFail()) {
    const KeptUpdates source = SourceOf(c);
    for (size_t block : kBlocks) {
      auto distances = PairwiseSquaredDistances(source, block);
      ASSERT_TRUE(distances.ok());
      auto scores = KrumScores(*distances, c.n, c.f);
      ASSERT_TRUE(scores.ok()) << scores.status().ToString();
      for (size_t i = 0; i < c.n; ++i) EXPECT_NEAR((*scores)[i], c.krum_scores[i], 1e-9 * c.krum_scores[i]) << i;
      auto order = KrumSelect(source, c.f, c.n - c.f, block);
      ASSERT_TRUE(order.ok()) << order.status().ToString();
      EXPECT_EQ(*order, std::vector<size_t>(c.krum_select.begin(), c.krum_select.begin() + ptrdiff_t(c.n - c.f)));
      std::vector<float> out(c.d);
      auto krum = MultiKrum(source, c.f, 1, out, block);
      ASSERT_TRUE(krum.ok());
      ASSERT_EQ(krum->size(), 1u);
      EXPECT_EQ((*krum)[0], c.krum_select[0]);
      EXPECT_EQ(out, c.updates[c.krum_select[0]]);  // Krum returns the chosen update itself
      ASSERT_TRUE(MultiKrum(source, c.f, c.n - c.f, out, block).ok());
      ExpectNear(out, c.multikrum, "multi-krum");
    }
  }
}

TEST(RobustOracleTest, BulyanMatchesNumpy) {
  for (const Case& c : LoadOrFail()) {
    const KeptUpdates source = SourceOf(c);
    for (size_t block : kBlocks) {
      std::vector<float> out(c.d);
      auto selected = Bulyan(source, c.f, out, block);
      ASSERT_TRUE(selected.ok()) << selected.status().ToString();
      EXPECT_EQ(*selected, c.bulyan_select) << "n = " << c.n;
      ExpectNear(out, c.bulyan, "bulyan");
    }
  }
}

}  // namespace
}  // namespace estuary::aggregation
