// LateSites: what a server restarted after its federation's last round owes
// the sites. It may have died between committing that round and every site
// reading that the federation was over; such a site reconnects for ever, and
// a server that stopped at once (--exit-when-done) would leave it doing so.
// Restarted complete, the server tells each site that says hello, and is done
// once every site of the round log has been told, or after `limit` (a site
// gone for good does not hold it longer). Runs on the core strand.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <set>
#include <string>

#include "server/clock.h"
#include "server/store.h"

namespace estuary::server {

class LateSites {
 public:
  // Waits for `owed`; `done` runs once: at once when `owed` is empty, when
  // the last of them is told, or when `limit` passes.
  void Start(std::set<std::string> owed, Clock& clock, std::chrono::milliseconds limit, std::function<void()> done);
  // `site` has been sent the federation's completion.
  void Told(const std::string& site);
  bool waiting() const { return static_cast<bool>(done_); }
  static std::chrono::milliseconds Limit(double seconds) {
    return std::chrono::milliseconds(int64_t(seconds * 1000));
  }

 private:
  void Done();

  std::set<std::string> owed_;
  std::unique_ptr<Timer> timer_;
  std::function<void()> done_;
};

// Every site the round log has seen (its clients table); empty, with a
// warning, when the log cannot be read.
std::set<std::string> SitesInRoundLog(Store& store);

}  // namespace estuary::server
