// Connections: what the server does with each session before and around the
// Coordinator; every Session reports to it (SessionListener).
//
// It records refused handshakes and bad frames in the store's events, checks
// that a Hello speaks this server's protocol, and keeps the revocation list:
// Revoke() closes every connected client whose certificate serial a reloaded
// list revokes, and a session whose handshake passed before that reload is
// refused the same way at its Hello (an Error CERTIFICATE_REVOKED, a
// certificate_revoked event, a warning in the log). A closed session then
// reaches the Coordinator as any lost connection does. Everything else passes
// to the Coordinator. Runs on the I/O thread.
#pragma once

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "crypto/revocation.h"
#include "server/client_session.h"
#include "server/coordinator.h"
#include "server/store.h"

namespace estuary::server {

class Connections final : public SessionListener {
 public:
  Connections(Coordinator& coordinator, Store& store) : coordinator_(coordinator), store_(store) {}

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
  void RecordEvent(const char* kind, const std::string& peer, const std::string& detail);

  Coordinator& coordinator_;
  Store& store_;
  std::set<std::string> revoked_serials_;  // the last reloaded list's
};

}  // namespace estuary::server
