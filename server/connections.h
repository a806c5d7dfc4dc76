// Connections: what the server does with each session before and around the
// Coordinator; every Session reports to it (SessionListener).
//
// It records refused handshakes and bad frames in the store's events and the
// log, a flood of them from one address in aggregate (EventThrottle: the
// first few in full, then one summary per interval), checks that a Hello
// speaks this server's protocol, and keeps the revocation list:
// Revoke() closes every connected client whose certificate serial a reloaded
// list revokes, and a session whose handshake passed before that reload is
// refused the same way at its Hello (an Error CERTIFICATE_REVOKED, a
// certificate_revoked event, a warning in the log). A closed session then
// reaches the Coordinator as any lost connection does. Everything else passes
// to the Coordinator. Runs on the Coordinator's strand.
#pragma once

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "crypto/revocation.h"
#include "server/client_session.h"
#include "server/clock.h"
#include "server/round_driver.h"
#include "server/event_throttle.h"
#include "server/store.h"

namespace estuary::server {

class Connections final : public SessionListener {
 public:
  // Repeated events from one address are summarised every `interval`.
  Connections(RoundDriver& coordinator, Store& store, Clock& clock,
              std::chrono::steady_clock::duration interval = std::chrono::seconds(10));

  // Writes `event` to the store (an error goes to the log).
  void RecordEvent(const Event& event);
  // The server stops: what the throttle counted is written now.
  void Stop();

  // `crl` is now the revocation list: closes the connected clients it
  // revokes, and returns their names.
  std::vector<std::string> Revoke(const crypto::CrlInfo& crl);

  void OnHandshakeRefused(const std::string& address, const std::string& reason) override;
  void OnBadFrame(ClientSession& session, const std::string& reason) override;
  void OnHello(const std::shared_ptr<ClientSession>& session, const v1::Hello& hello) override;
  void OnMessage(const std::shared_ptr<ClientSession>& session, v1::Envelope envelope) override;
  void OnClosed(ClientSession& session) override;

 private:
  // Tells the session its certificate is revoked, records it and closes it.
  void CloseAsRevoked(ClientSession& session, const char* action);
  // Logs and records one event unless the throttle counts it instead.
  void Report(const char* kind, const std::string& host, const std::string& peer, const std::string& detail);
  void ArmFlush();
  void WriteSummaries(const std::vector<EventThrottle::Summary>& summaries);

  RoundDriver& coordinator_;
  Store& store_;
  Clock& clock_;
  EventThrottle throttle_;
  std::unique_ptr<Timer> flush_;
  bool flush_armed_ = false;
  bool stopped_ = false;
  std::set<std::string> revoked_serials_;  // the last reloaded list's
};

}  // namespace estuary::server
