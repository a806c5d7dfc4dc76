#include "server/event_throttle.h"

#include <fmt/format.h>

namespace estuary::server {

std::string EventThrottle::Summary::Describe() const {
  return fmt::format("{} more in the last {:.0f} s; the last: {}", count, seconds, last_detail);
}

bool EventThrottle::Admit(const std::string& kind, const std::string& host, const std::string& detail, TimePoint now) {
  if (now - window_started_ >= interval_) {
    window_started_ = now;
    full_in_window_ = 0;
  }
  auto it = keys_.find({kind, host});
  if (it == keys_.end()) {
    const bool other = keys_.size() >= kMaxKeys;
    it = keys_.try_emplace({kind, other ? std::string("other addresses") : host}, Key{.started = now}).first;
  }
  Key& key = it->second;
  if (key.full < kFullPerKey && full_in_window_ < kFullPerInterval) {
    ++key.full;
    ++full_in_window_;
    return true;
  }
  ++key.count;
  key.last_detail = detail;
  return false;
}

std::vector<EventThrottle::Summary> EventThrottle::FlushIf(TimePoint now, bool all) {
  std::vector<Summary> out;
  for (auto it = keys_.begin(); it != keys_.end();) {
    Key& key = it->second;
    if (!all && now - key.started < interval_) {
      ++it;
      continue;
    }
    if (key.count == 0) {
      it = keys_.erase(it);
      continue;
    }
    out.push_back({it->first.first, it->first.second, key.count,
                   std::chrono::duration<double>(now - key.started).count(), key.last_detail});
    // Still flooding: the next interval is counted from here, with no event in full.
    key.started = now;
    key.count = 0;
    ++it;
  }
  return out;
}

std::vector<EventThrottle::Summary> EventThrottle::Flush(TimePoint now) { return FlushIf(now, false); }

std::vector<EventThrottle::Summary> EventThrottle::FlushAll(TimePoint now) { return FlushIf(now, true); }

std::optional<EventThrottle::TimePoint> EventThrottle::NextFlush() const {
  std::optional<TimePoint> next;
  for (const auto& [id, key] : keys_) {
    if (!next || key.started + interval_ < *next) next = key.started + interval_;
  }
  return next;
}

std::string HostOf(const std::string& address) {
  if (!address.empty() && address.front() == '[') {
    const auto close = address.find(']');
    return close == std::string::npos ? address : address.substr(1, close - 1);
  }
  const auto colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

}  // namespace estuary::server
