// EventThrottle: what a flood of one kind of event from one peer costs the
// log and the round log: the first few written in full, then a count per
// interval.
//
// Events are keyed by kind and host (the peer's address without its port, so
// a flood over many connections is one key). The first kFullPerKey events of
// a key are written in full; later ones are counted, and every interval that
// counted some ends in one summary of them. A key whose interval passes with
// nothing counted is forgotten: its next event is written in full again.
// Over all keys, at most kFullPerInterval events per interval are written in
// full, and at most kMaxKeys hosts are told apart (the rest count under the
// host "other addresses"), so a flood from many addresses is bounded too.
// Single-threaded: the owner's strand.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace estuary::server {

class EventThrottle {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  static constexpr uint32_t kFullPerKey = 5;
  static constexpr uint32_t kFullPerInterval = 100;
  static constexpr size_t kMaxKeys = 256;

  struct Summary {
    std::string kind;
    std::string host;
    uint64_t count = 0;
    double seconds = 0;       // the interval the count covers
    std::string last_detail;  // the detail of the last event counted
    // "495 more in the last 10 s; the last: DETAIL"
    std::string Describe() const;
  };

  explicit EventThrottle(std::chrono::steady_clock::duration interval) : interval_(interval) {}

  // True: write this event in full. False: it is counted into its key's
  // next summary.
  bool Admit(const std::string& kind, const std::string& host, const std::string& detail, TimePoint now);
  // The summaries of every key whose interval ended by `now`, oldest key
  // first; those keys start their next interval, or are forgotten.
  std::vector<Summary> Flush(TimePoint now);
  // Every count now, whether or not its interval ended (at shutdown).
  std::vector<Summary> FlushAll(TimePoint now);
  // When the next interval ends, while any key is held.
  std::optional<TimePoint> NextFlush() const;

 private:
  struct Key {
    TimePoint started;
    uint32_t full = 0;
    uint64_t count = 0;
    std::string last_detail;
  };

  std::vector<Summary> FlushIf(TimePoint now, bool all);

  const std::chrono::steady_clock::duration interval_;
  std::map<std::pair<std::string, std::string>, Key> keys_;  // (kind, host)
  TimePoint window_started_{};
  uint32_t full_in_window_ = 0;
};

// "10.0.0.9:4000" -> "10.0.0.9", "[::1]:4000" -> "::1".
std::string HostOf(const std::string& address);

}  // namespace estuary::server
