// BufferBudget: the bytes that every session together may hold in frames
// being received and model chunks being sent, so that many connections each
// announcing a large frame, or many downloads at once, cannot take the
// server's memory.
//
// Lock-free: sessions on any thread take and give. A session that cannot
// take what it needs waits and tries again (Session); small control frames
// are forced through (Force), since each session bounds its own queue. The
// most taken at once is kept (TakePeak), so the server can give memory back
// to the system once a burst has passed.
#pragma once

#include <atomic>
#include <cstdint>

namespace estuary::server {

class BufferBudget {
 public:
  explicit BufferBudget(uint64_t limit) : limit_(limit) {}
  BufferBudget(const BufferBudget&) = delete;
  BufferBudget& operator=(const BufferBudget&) = delete;

  // Takes `bytes` if they fit under the limit.
  bool TryTake(uint64_t bytes) {
    uint64_t used = used_.load(std::memory_order_relaxed);
    do {
      if (used + bytes > limit_) return false;
    } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
    NotePeak(used + bytes);
    return true;
  }
  // Takes `bytes` whether or not they fit.
  void Force(uint64_t bytes) { NotePeak(used_.fetch_add(bytes, std::memory_order_relaxed) + bytes); }
  void Give(uint64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }

  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  uint64_t limit() const { return limit_; }
  // The most taken at once since the last call; starts over from what is
  // taken now.
  uint64_t TakePeak() { return peak_.exchange(used(), std::memory_order_relaxed); }

 private:
  void NotePeak(uint64_t used) {
    uint64_t peak = peak_.load(std::memory_order_relaxed);
    while (used > peak && !peak_.compare_exchange_weak(peak, used, std::memory_order_relaxed)) {
    }
  }

  const uint64_t limit_;
  std::atomic<uint64_t> used_{0};
  std::atomic<uint64_t> peak_{0};
};

}  // namespace estuary::server
