// Server: the TLS listener that owns the Coordinator, the Store and the
// worker thread that folds, evaluates and checkpoints.
//
// Run() accepts connections on the configured address until SIGINT/SIGTERM,
// or, with exit_when_done, until the last round has been committed and
// announced. SIGHUP rereads the revocation list (tls.crl): later handshakes
// check against it, connected clients it revokes are closed (Connections),
// and a bad file is logged and changes nothing. While the list nears its next
// update (past it, every handshake fails) the log says so, on loading and
// daily. "listening on HOST:PORT" goes to stdout once the socket is bound, so
// a parent process can learn the port when it asked for port 0.
#pragma once

#include "base/asio.h"
#include <memory>

#include "base/status.h"
#include "server/clock.h"
#include "server/config.h"
#include "server/connections.h"
#include "server/coordinator.h"
#include "server/store.h"

namespace estuary::server {

class Server {
 public:
  // Opens the store, loads certificates, recovers the federation and binds.
  static Result<std::unique_ptr<Server>> Create(ServerConfig config);
  ~Server();

  // Serves until stopped. Returns the port it was bound to via port().
  Status Run();
  uint16_t port() const { return port_; }

 private:
  explicit Server(ServerConfig config) : config_(std::move(config)) {}
  void Accept();
  void Stop();
  void AwaitReload();
  void ReloadCrl();
  void WatchCrlExpiry();

  ServerConfig config_;
  boost::asio::io_context io_{1};
  std::shared_ptr<boost::asio::ssl::context> tls_;
  std::unique_ptr<Store> store_;
  boost::asio::thread_pool worker_{1};  // folds, evaluation, checkpoints: never the I/O thread
  AsioClock clock_{io_.get_executor()};
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<Connections> connections_;
  std::unique_ptr<boost::asio::ip::tcp::acceptor> acceptor_;
  std::unique_ptr<boost::asio::signal_set> signals_;
  std::unique_ptr<boost::asio::signal_set> reload_;  // SIGHUP
  boost::asio::steady_timer crl_timer_{io_};
  std::chrono::system_clock::time_point crl_next_update_;  // the loaded list's
  uint16_t port_ = 0;
  bool stopping_ = false;
};

}  // namespace estuary::server
