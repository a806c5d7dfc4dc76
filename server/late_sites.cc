#include "server/late_sites.h"

#include <spdlog/spdlog.h>

namespace estuary::server {

void LateSites::Start(std::set<std::string> owed, Clock& clock, std::chrono::milliseconds limit,
                      std::function<void()> done) {
  owed_ = std::move(owed);
  done_ = std::move(done);
  if (owed_.empty()) return Done();
  spdlog::info("the federation was complete before this start: telling the {} sites of the round log as they "
               "reconnect (at most {} s)",
               owed_.size(), std::chrono::duration<double>(limit).count());
  timer_ = clock.MakeTimer();
  timer_->Arm(limit, [this] {
    spdlog::info("{} sites of the round log did not reconnect to be told the federation is complete",
                 owed_.size());
    Done();
  });
}

void LateSites::Told(const std::string& site) {
  if (!done_ || owed_.erase(site) == 0 || !owed_.empty()) return;
  Done();
}

void LateSites::Done() {
  if (timer_) timer_->Cancel();
  // Moved out first: `done` may stop the server, which reaches back here.
  auto done = std::move(done_);
  done_ = nullptr;
  if (done) done();
}

std::set<std::string> SitesInRoundLog(Store& store) {
  std::set<std::string> sites;
  auto clients = store.Clients();
  if (!clients.ok()) {
    spdlog::warn("cannot list the round log's sites to tell them the federation is complete: {}",
                 clients.status().ToString());
    return sites;
  }
  for (const ClientRecord& client : *clients) sites.insert(client.name);
  return sites;
}

}  // namespace estuary::server
