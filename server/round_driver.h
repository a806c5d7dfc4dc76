// RoundDriver: what the Server and Connections ask of the round logic,
// whichever runs the federation: Coordinator (synchronous rounds) or
// AsyncCoordinator (FedBuff's asynchronous versions). Every call runs on the
// core strand (server.h).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "estuary.pb.h"
#include "proto/event_file.h"
#include "server/client_session.h"
#include "server/metrics.h"

namespace estuary::server {

// The connected clients by certificate name, as both drivers keep them.
using SessionsByName = std::map<std::string, std::shared_ptr<ClientSession>>;

// Their sessions, in name order (RoundDriver::Connected).
inline std::vector<std::shared_ptr<ClientSession>> SessionsOf(const SessionsByName& sites) {
  std::vector<std::shared_ptr<ClientSession>> sessions;
  sessions.reserve(sites.size());
  for (const auto& [name, session] : sites) sessions.push_back(session);
  return sessions;
}

inline void SendToAll(const SessionsByName& sites, const v1::Envelope& envelope) {
  for (const auto& [name, session] : sites) session->Send(envelope);
}

// Takes a copy: a session closed here may leave the driver's map before the loop ends.
inline void CloseAllAfterWrites(SessionsByName sites) {
  for (auto& [name, session] : sites) session->CloseAfterWrites();
}

class RoundDriver {
 public:
  virtual ~RoundDriver() = default;

  // Builds the federation, then loads the last committed round's (version's)
  // checkpoint, or starts from the initial model.
  virtual Status Recover() = 0;
  // A hello from a session that passed the connection's checks; it replaces
  // an earlier connection under the same name.
  virtual void OnHello(const std::shared_ptr<ClientSession>& session, const v1::Hello& hello) = 0;
  virtual void OnMessage(const std::shared_ptr<ClientSession>& session, v1::Envelope envelope) = 0;
  virtual void OnClosed(ClientSession& session) = 0;

  // Called once the federation is complete.
  virtual void set_on_complete(std::function<void()> fn) = 0;
  // Where rounds, sites, rejections and folds are counted; null: nowhere.
  virtual void set_metrics(Metrics* metrics) = 0;
  // Each committed round's scalars go to `events` too (serve --tensorboard).
  virtual void set_event_file(proto::EventFile* events) = 0;
  // Lets every connected client finish reading what is queued, then closes
  // it; a Hello from then on is closed the same way.
  virtual void CloseAll() = 0;
  // The sessions of the connected clients, in name order.
  virtual std::vector<std::shared_ptr<ClientSession>> Connected() const = 0;
  virtual bool complete() const = 0;
  // Restarted complete: tells each site of the round log that the federation
  // is over as it says hello, and calls on_complete once all have been told,
  // or after idle_timeout (late_sites.h).
  virtual void TellLateSites() = 0;
};

}  // namespace estuary::server
