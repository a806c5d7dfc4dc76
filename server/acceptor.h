// Acceptor: the server's front door. It accepts connections, decides which
// may start a handshake, and makes a Session of each.
//
// A connection is pending from accept until its session says Hello (or
// closes): at most max_handshakes are pending at once, and at most
// max_handshakes_per_address from one peer address (an IPv4 address, or an
// IPv6 /64: a host may take any address of its block). A connection
// beyond either is closed at once, before any TLS, counted, and logged and
// recorded as a connection_refused event in aggregate (EventThrottle). When
// the process runs out of descriptors, accepting does not spin: what waits
// in the backlog is accepted and closed with a reserve descriptor, so those
// peers hear at once, and accepting resumes after a pause, with one log line
// per interval. Quiesce() runs a task once no TLS handshake is in flight and
// none can start: the server swaps the trust store there, which OpenSSL
// reads during handshakes on any thread. Stop() closes the listening socket
// and every pending session.
//
// Everything runs on the strand the listening socket was opened on; Start,
// Stop and Quiesce may be called from any thread.
#pragma once

#include "base/asio.h"
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "server/event_throttle.h"
#include "server/session.h"
#include "server/store.h"

namespace estuary::server {

struct ServerConfig;

class Acceptor {
 public:
  // `listener` is bound and listening, on the acceptor's strand; every
  // session gets a strand of its own on `io`. `record` is given each event
  // to write (it may carry it to another strand).
  Acceptor(boost::asio::io_context& io, boost::asio::ip::tcp::acceptor listener,
           std::shared_ptr<boost::asio::ssl::context> tls, const Session::Context& sessions,
           const ServerConfig& config, std::function<void(Event)> record);
  ~Acceptor();

  void Start();
  void Stop();
  void Quiesce(std::function<void()> task);

 private:
  struct Pending {
    std::weak_ptr<Session> session;
    std::string host;
    bool handshaking = true;
  };

  void Accept();
  void OnAccept(const boost::system::error_code& ec, boost::asio::ip::tcp::socket socket);
  void Admit(boost::asio::ip::tcp::socket socket);
  void Refuse(boost::asio::ip::tcp::socket socket, const std::string& address, const std::string& host,
              const std::string& reason);
  void OnDescriptorsExhausted(const boost::system::error_code& ec);
  void OnHandshakeEnded(uint64_t id);
  void OnIdentified(uint64_t id);
  void RunQuiescedTasks();
  void WriteSummaries(const std::vector<EventThrottle::Summary>& summaries);
  void ArmFlush();

  boost::asio::io_context& io_;
  boost::asio::ip::tcp::acceptor listener_;
  const std::shared_ptr<boost::asio::ssl::context> tls_;
  const Session::Context sessions_;
  const ServerConfig& config_;
  const std::function<void(Event)> record_;
  boost::asio::steady_timer pause_;  // after running out of descriptors
  boost::asio::steady_timer flush_;  // the throttle's next summaries
  EventThrottle throttle_;
  bool flush_armed_ = false;
  int reserve_ = -1;  // a descriptor held back to shed connections when none is left

  std::map<uint64_t, Pending> pending_;
  std::map<std::string, uint32_t> pending_by_host_;
  uint32_t handshaking_ = 0;
  uint64_t next_id_ = 0;
  bool accepting_ = false;
  bool stopped_ = false;
  std::vector<std::function<void()>> quiesced_;               // tasks waiting for no handshake
  std::vector<boost::asio::ip::tcp::socket> held_;            // accepted while they wait

  uint64_t exhausted_shed_ = 0;  // connections closed unserved since the last log line
  std::chrono::steady_clock::time_point exhausted_logged_{};
  bool exhausted_ = false;
};

}  // namespace estuary::server
