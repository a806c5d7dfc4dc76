// The seam between one client's connection and the server's round logic,
// both ways.
//
// ClientSession is what the Coordinator and its parts ask of a connection;
// SessionListener is what a connection reports. Session (session.h) is the
// TLS implementation of the first and Connections (connections.h) the
// server's implementation of the second; tests put fakes in their place, so
// the round logic runs without sockets. The listener's calls, and the
// ClientSession calls it makes, all run on one strand (the Coordinator's): a
// Session carries each call over to its own strand, and reports back by
// posting to the listener's, in the order things happened on the connection.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "estuary.pb.h"

namespace estuary::server {

class ClientSession {
 public:
  virtual ~ClientSession() = default;

  // The common name of the client's verified certificate, its serial
  // (crypto::PeerSerial) and the peer's "host:port".
  virtual const std::string& name() const = 0;
  virtual const std::string& peer_serial() const = 0;
  virtual const std::string& address() const = 0;

  // Queues one frame; ignored once the session is closed or closing.
  virtual void Send(const v1::Envelope& envelope) = 0;
  // Streams `model` as ModelChunk frames for `round` after what is queued:
  // all of it, or only the byte ranges [begin, end) of `ranges` (ascending,
  // disjoint, non-empty; no chunk crosses one). Offsets past the model's end
  // address `tail` from its start. `on_sent` runs once, on the caller's
  // strand: when the last chunk is written or the session closes. The model
  // is shared, never copied.
  virtual void SendModel(uint64_t round, std::shared_ptr<const std::vector<float>> model,
                         std::function<void()> on_sent, std::vector<std::pair<uint64_t, uint64_t>> ranges,
                         std::shared_ptr<const std::vector<float>> tail) = 0;
  // Sends an Error, then closes once it is written.
  virtual void SendErrorAndClose(v1::Error::Code code, const std::string& message) = 0;
  // Closes once everything queued is written.
  virtual void CloseAfterWrites() = 0;
  // Backpressure: no frame is read from the client after the one being
  // handled until Resume(); meanwhile its idle timeout does not run.
  virtual void Pause() = 0;
  virtual void Resume() = 0;
  // Closed: nothing more is sent or read, and the listener is told
  // (OnClosed) if the session had said hello. Safe from any thread.
  virtual bool closed() const = 0;
};

class SessionListener {
 public:
  virtual ~SessionListener() = default;

  // The TLS handshake failed, or the certificate named no client.
  virtual void OnHandshakeRefused(const std::string& address, const std::string& reason) = 0;
  // A frame could not be parsed, or came out of order; the session answers
  // it with an Error and closes.
  virtual void OnBadFrame(ClientSession& session, const std::string& reason) = 0;
  // The first message of a session, and every later one but heartbeats.
  virtual void OnHello(const std::shared_ptr<ClientSession>& session, const v1::Hello& hello) = 0;
  virtual void OnMessage(const std::shared_ptr<ClientSession>& session, v1::Envelope envelope) = 0;
  // A session that had said hello is closed, for whatever reason.
  virtual void OnClosed(ClientSession& session) = 0;
};

}  // namespace estuary::server
