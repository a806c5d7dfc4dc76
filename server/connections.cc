#include "server/connections.h"

#include <spdlog/spdlog.h>

#include "proto/frame.h"

namespace estuary::server {

void Connections::RecordEvent(const char* kind, const std::string& peer, const std::string& detail) {
  Status recorded = store_.RecordEvent({NowMs(), kind, peer, detail});
  if (!recorded.ok()) spdlog::error("store: {}", recorded.ToString());
}

void Connections::OnHandshakeRefused(const std::string& address, const std::string& reason) {
  spdlog::warn("handshake refused from {}: {}", address, reason);
  RecordEvent("handshake_refused", address, reason);
}

void Connections::OnBadFrame(ClientSession& session, const std::string& reason) {
  spdlog::warn("bad frame from {} ({}): {}", session.name(), session.address(), reason);
  RecordEvent("frame_rejected", session.name() + "@" + session.address(), reason);
}

void Connections::OnHello(const std::shared_ptr<ClientSession>& session, const v1::Hello& hello) {
  if (hello.protocol_version() != proto::kProtocolVersion) {
    return session->SendErrorAndClose(
        v1::Error::BAD_MESSAGE,
        fmt::format("protocol version {} not supported (server speaks {})", hello.protocol_version(),
                    proto::kProtocolVersion));
  }
  if (revoked_serials_.contains(session->peer_serial())) {
    // Its handshake passed before the list that revokes it was loaded.
    return CloseAsRevoked(*session, "refusing its hello");
  }
  coordinator_.OnHello(session, hello);
}

void Connections::OnMessage(const std::shared_ptr<ClientSession>& session, v1::Envelope envelope) {
  coordinator_.OnMessage(session, std::move(envelope));
}

void Connections::OnClosed(ClientSession& session) { coordinator_.OnClosed(session); }

std::vector<std::string> Connections::Revoke(const crypto::CrlInfo& crl) {
  revoked_serials_.clear();
  for (const auto& r : crl.revoked) revoked_serials_.insert(r.serial);
  std::vector<std::string> closed;
  for (const auto& session : coordinator_.Connected()) {  // a copy: closing one edits the Coordinator's
    if (!revoked_serials_.contains(session->peer_serial())) continue;
    CloseAsRevoked(*session, "closing its connection");
    closed.push_back(session->name());
  }
  return closed;
}

void Connections::CloseAsRevoked(ClientSession& session, const char* action) {
  const std::string& serial = session.peer_serial();
  spdlog::warn("{} ({}): certificate serial {} is revoked; {}", session.name(), session.address(), serial, action);
  RecordEvent("certificate_revoked", session.name() + "@" + session.address(), "serial " + serial);
  session.SendErrorAndClose(v1::Error::CERTIFICATE_REVOKED,
                            fmt::format("certificate serial {} is revoked by the federation", serial));
}

}  // namespace estuary::server
