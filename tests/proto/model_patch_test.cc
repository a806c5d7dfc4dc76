// ModelPatch (proto/model_patch.h): what a client that holds the previous
// model accepts from a RoundStart's patch, the one line it answers anything
// else with, and the server's writing of it read back the same.
#include <gtest/gtest.h>

#include <array>
#include <string>
#include <utility>
#include <vector>

#include "proto/model_patch.h"

namespace estuary::proto {
namespace {

// a [4, 6] at 0, w [16, 32] at 24, w2 [16, 32] at 536, b [8] at 1048: 1056 elements.
Manifest Layout() {
  Manifest m;
  m.Append("a", {4, 6});
  m.Append("w", {16, 32});
  m.Append("w2", {16, 32});
  m.Append("b", {8});
  return m;
}

v1::RoundStart Start(std::vector<std::pair<uint64_t, uint64_t>> ranges,
                     std::vector<std::array<uint64_t, 4>> low_rank) {
  v1::RoundStart start;
  start.set_round(7);
  for (const auto& [offset, count] : ranges) {
    auto* r = start.add_patch();
    r->set_offset(offset);
    r->set_count(count);
  }
  for (const auto& [offset, rows, cols, rank] : low_rank) {
    auto* p = start.add_low_rank();
    p->set_offset(offset);
    p->set_rows(rows);
    p->set_cols(cols);
    p->set_rank(rank);
  }
  return start;
}

TEST(ModelPatch, RangesThenTheFactorsPastTheEnd) {
  auto patch = ReadModelPatch(Start({{0, 24}, {1048, 8}}, {{24, 16, 32, 2}, {536, 16, 32, 3}}), Layout());
  ASSERT_TRUE(patch.ok()) << patch.status().ToString();
  const uint64_t factors = 2 * (16 + 32) + 3 * (16 + 32);
  EXPECT_EQ(patch->factor_count(), factors);
  const std::vector<std::pair<uint64_t, uint64_t>> want = {
      {0, 24 * 4}, {1048 * 4, 1056 * 4}, {1056 * 4, (1056 + factors) * 4}};
  EXPECT_EQ(patch->ByteRanges(1056), want);
  ASSERT_EQ(patch->low_rank.size(), 2u);
  EXPECT_EQ(patch->low_rank[1].offset, 536u);
  EXPECT_EQ(patch->low_rank[1].rows, 16u);
  EXPECT_EQ(patch->low_rank[1].cols, 32u);
  EXPECT_EQ(patch->low_rank[1].rank, 3u);

  auto dense_only = ReadModelPatch(Start({{24, 512}}, {}), Layout());
  ASSERT_TRUE(dense_only.ok());
  EXPECT_EQ(dense_only->ByteRanges(1056).size(), 1u);
  EXPECT_EQ(dense_only->factor_count(), 0u);
}

TEST(ModelPatch, WhatTheServerWritesTheClientReadsBack) {
  ModelPatch written;
  written.ranges = {{0, 24}, {1048, 8}};
  written.low_rank = {{.offset = 24, .rows = 16, .cols = 32, .rank = 2}, {.offset = 536, .rows = 16, .cols = 32, .rank = 3}};
  v1::RoundStart start = Start({{5, 5}}, {{24, 16, 32, 9}});  // replaced, not added to
  start.set_round(7);
  WriteModelPatch(written, &start);
  auto read = ReadModelPatch(start, Layout());
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(read->ranges, written.ranges);
  EXPECT_EQ(read->low_rank, written.low_rank);
  EXPECT_EQ(read->range_elements(), 32u);
  EXPECT_EQ(read->ByteRanges(1056), written.ByteRanges(1056));

  WriteModelPatch(ModelPatch{}, &start);
  EXPECT_EQ(start.patch_size(), 0);
  EXPECT_EQ(start.low_rank_size(), 0);
}

TEST(ModelPatch, AnythingElseIsOneLineNamingTheEntry) {
  struct Case {
    v1::RoundStart start;
    std::string expected;
  };
  const Case cases[] = {
      {Start({{1050, 10}}, {}), "round 7: patch range 1050 (+10) is not ascending within the model's 1056"},
      {Start({{24, 8}, {0, 8}}, {}), "patch range 0 (+8) is not ascending"},
      {Start({{0, 0}}, {}), "patch range 0 (+0)"},
      {Start({}, {{25, 16, 32, 2}}), "round 7: low-rank patch at element 25 (16 x 32, rank 2): is not a whole tensor"},
      {Start({}, {{24, 8, 64, 2}}), "(8 x 64, rank 2): is not a whole tensor of the model, rows by the rest"},
      {Start({}, {{1048, 8, 1, 1}}), "(8 x 1, rank 1): is not smaller as factors than the tensor's 8 values"},
      {Start({}, {{24, 16, 32, 11}}), "rank 11): is not smaller as factors"},
      {Start({}, {{24, 16, 32, 0}}), "rank 0): is not smaller as factors"},
      {Start({}, {{24, 16, 32, uint64_t(1) << 62}}), "is not smaller as factors"},
      {Start({{24, 512}}, {{24, 16, 32, 2}}), "element 24 (16 x 32, rank 2): is out of order or inside a patch range"},
      {Start({}, {{536, 16, 32, 2}, {24, 16, 32, 2}}), "element 24 (16 x 32, rank 2): is out of order"},
  };
  for (const Case& c : cases) {
    auto patch = ReadModelPatch(c.start, Layout());
    ASSERT_FALSE(patch.ok()) << c.expected;
    EXPECT_NE(patch.status().message().find(c.expected), std::string::npos) << patch.status().message();
    EXPECT_EQ(patch.status().message().find('\n'), std::string::npos);
  }
}

}  // namespace
}  // namespace estuary::proto
