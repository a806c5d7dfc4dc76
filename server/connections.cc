#include "server/connections.h"

#include <spdlog/spdlog.h>

#include "proto/frame.h"

namespace estuary::server {

namespace {

// How each kind of event reads in the log.
const char* Said(const std::string& kind) {
  if (kind == "handshake_refused") return "handshake refused";
  if (kind == "frame_rejected") return "bad frame";
  return kind.c_str();
}

}  // namespace

Connections::Connections(RoundDriver& coordinator, Store& store, Clock& clock,
                         std::chrono::steady_clock::duration interval)
    : coordinator_(coordinator), store_(store), clock_(clock), throttle_(interval), flush_(clock.MakeTimer()) {}

void Connections::RecordEvent(const Event& event) {
  Status recorded = store_.RecordEvent(event);
  if (!recorded.ok()) spdlog::error("store: {}", recorded.ToString());
}

void Connections::Report(const char* kind, const std::string& host, const std::string& peer,
                         const std::string& detail) {
  if (throttle_.Admit(kind, host, detail, clock_.Now())) {
    spdlog::warn("{} from {}: {}", Said(kind), peer, detail);
    RecordEvent({clock_.UnixMs(), kind, peer, detail});
  }
  // Once stopped, no timer may keep the server from exiting: what is counted
  // is written at once (the sessions still closing, no more).
  if (stopped_) return WriteSummaries(throttle_.FlushAll(clock_.Now()));
  ArmFlush();
}

void Connections::ArmFlush() {
  const auto next = throttle_.NextFlush();
  if (flush_armed_ || stopped_ || !next) return;
  flush_armed_ = true;
  flush_->Arm(*next - clock_.Now(), [this] {
    flush_armed_ = false;
    WriteSummaries(throttle_.Flush(clock_.Now()));
    ArmFlush();
  });
}

void Connections::WriteSummaries(const std::vector<EventThrottle::Summary>& summaries) {
  for (const auto& s : summaries) {
    spdlog::warn("{}: {} more from {} in the last {:.0f} s; the last: {}", Said(s.kind), s.count, s.host, s.seconds,
                 s.last_detail);
    RecordEvent({clock_.UnixMs(), s.kind, s.host, s.Describe()});
  }
}

void Connections::Stop() {
  stopped_ = true;
  flush_->Cancel();
  flush_armed_ = false;
  WriteSummaries(throttle_.FlushAll(clock_.Now()));
}

void Connections::OnHandshakeRefused(const std::string& address, const std::string& reason) {
  Report("handshake_refused", HostOf(address), address, reason);
}

void Connections::OnBadFrame(ClientSession& session, const std::string& reason) {
  Report("frame_rejected", session.name() + "@" + HostOf(session.address()), session.name() + "@" + session.address(),
         reason);
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
  RecordEvent({clock_.UnixMs(), "certificate_revoked", session.name() + "@" + session.address(), "serial " + serial});
  session.SendErrorAndClose(v1::Error::CERTIFICATE_REVOKED,
                            fmt::format("certificate serial {} is revoked by the federation", serial));
}

}  // namespace estuary::server
