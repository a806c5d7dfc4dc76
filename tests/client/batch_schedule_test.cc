#include "client/batch_schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

namespace estuary::client {
namespace {

std::vector<uint32_t> Items(uint32_t n) {
  std::vector<uint32_t> items(n);
  std::iota(items.begin(), items.end(), 100u);
  return items;
}

TaskConfig Task(uint32_t epochs, uint32_t batch, uint32_t max_steps = 0) {
  TaskConfig task;
  task.epochs = epochs;
  task.batch_size = batch;
  task.max_local_steps = max_steps;
  task.seed = 7;
  return task;
}

struct Walk {
  std::vector<std::vector<uint32_t>> batches;
  std::vector<uint32_t> epochs;
  std::vector<bool> starts;
};

Walk WalkOf(BatchSchedule schedule) {
  Walk walk;
  while (schedule.Next()) {
    walk.batches.emplace_back(schedule.batch().begin(), schedule.batch().end());
    walk.epochs.push_back(schedule.epoch());
    walk.starts.push_back(schedule.starts_epoch());
  }
  return walk;
}

TEST(BatchSchedule, EveryEpochVisitsEveryItemOnceInBatchesWithAShortLastOne) {
  const Walk walk = WalkOf(BatchSchedule(Items(23), Task(3, 5), 4, "site-a"));
  ASSERT_EQ(walk.batches.size(), 15u);  // 5 batches an epoch: 5, 5, 5, 5, 3
  std::vector<std::vector<uint32_t>> orders(3);
  for (size_t i = 0; i < walk.batches.size(); ++i) {
    EXPECT_EQ(walk.epochs[i], i / 5);
    EXPECT_EQ(walk.starts[i], i % 5 == 0);
    EXPECT_EQ(walk.batches[i].size(), i % 5 == 4 ? 3u : 5u);
    auto& order = orders[walk.epochs[i]];
    order.insert(order.end(), walk.batches[i].begin(), walk.batches[i].end());
  }
  for (auto& order : orders) {
    std::vector<uint32_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, Items(23));
  }
  EXPECT_NE(orders[0], orders[1]) << "each epoch is shuffled afresh";
  EXPECT_NE(orders[0], Items(23));
}

TEST(BatchSchedule, TheSameSeedRoundAndNameGiveTheSameOrderAndAnyOtherDoesNot) {
  const auto walk = [](uint64_t seed, uint64_t round, std::string_view name) {
    TaskConfig task = Task(2, 4);
    task.seed = seed;
    return WalkOf(BatchSchedule(Items(17), task, round, name)).batches;
  };
  EXPECT_EQ(walk(7, 3, "site-a"), walk(7, 3, "site-a"));
  EXPECT_NE(walk(7, 3, "site-a"), walk(8, 3, "site-a"));
  EXPECT_NE(walk(7, 3, "site-a"), walk(7, 4, "site-a"));
  EXPECT_NE(walk(7, 3, "site-a"), walk(7, 3, "site-b"));
}

TEST(BatchSchedule, MaxLocalStepsEndsTheRoundMidEpochWithTheSameBatchesUpToThere) {
  const Walk full = WalkOf(BatchSchedule(Items(20), Task(3, 6), 1, "s"));
  const Walk cut = WalkOf(BatchSchedule(Items(20), Task(3, 6, 6), 1, "s"));
  ASSERT_EQ(full.batches.size(), 12u);
  ASSERT_EQ(cut.batches.size(), 6u);
  for (size_t i = 0; i < cut.batches.size(); ++i) EXPECT_EQ(cut.batches[i], full.batches[i]) << "batch " << i;
  EXPECT_EQ(cut.epochs.back(), 1u);
}

TEST(BatchSchedule, NothingToVisitGivesNoBatch) {
  EXPECT_TRUE(WalkOf(BatchSchedule({}, Task(3, 4), 1, "s")).batches.empty());
  EXPECT_EQ(WalkOf(BatchSchedule(Items(3), Task(2, 10), 1, "s")).batches.size(), 2u);  // one short batch an epoch
}

}  // namespace
}  // namespace estuary::client
