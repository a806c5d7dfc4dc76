// ParallelFor: body(i) for every i in [0, n), on up to `threads` threads.
//
// The calling thread is one of them. Each thread takes the next index as it
// finishes one, so the order is not fixed: body(i) writes only what index i
// owns (slot i of a vector sized beforehand), or synchronises. Returns when
// every body has returned. A body must not throw.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <thread>
#include <vector>

namespace estuary {

template <typename Body>
void ParallelFor(size_t n, size_t threads, const Body& body) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) body(i);
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < std::min(threads, n); ++t) pool.emplace_back(work);
  work();
  for (auto& thread : pool) thread.join();
}

}  // namespace estuary
