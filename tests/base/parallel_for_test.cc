#include "base/parallel_for.h"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace estuary {
namespace {

TEST(ParallelFor, EveryIndexRunsOnceWhateverTheThreads) {
  for (size_t threads : {1, 2, 3, 8, 100}) {
    for (size_t n : {0, 1, 7, 1000}) {
      std::vector<int> runs(n, 0);
      ParallelFor(n, threads, [&](size_t i) { ++runs[i]; });
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(runs[i], 1) << "n " << n << " threads " << threads << " index " << i;
    }
  }
}

TEST(ParallelFor, TheWorkIsSharedBetweenThreadsAndTheCallerIsOne) {
  std::mutex mu;
  std::set<std::thread::id> seen;
  // Each body waits until two threads have started one, which a single thread never would.
  std::atomic<int> started{0};
  ParallelFor(2, 2, [&](size_t) {
    ++started;
    while (started.load() < 2) std::this_thread::yield();
    std::lock_guard lock(mu);
    seen.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_TRUE(seen.count(std::this_thread::get_id()));
}

}  // namespace
}  // namespace estuary
