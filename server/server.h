// Server: the TLS listener that owns the Coordinator, the Store and the
// worker thread that folds, evaluates and checkpoints.
//
// Its I/O runs on an io_context that io_threads threads run: each session on
// a strand of its own, so a slow handshake holds one thread, not the server;
// the Coordinator, Connections and the Store on one strand (the core), so the
// round logic needs no locks; the Acceptor, the signals and the revocation
// list on another (the front). Frames buffered, all sessions together, are
// bounded (BufferBudget, frame_memory_bytes), and once a burst of them has
// passed the memory they held goes back to the system.
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
#include <string>

#include "base/status.h"
#include "server/acceptor.h"
#include "server/buffer_budget.h"
#include "server/clock.h"
#include "server/config.h"
#include "server/connections.h"
#include "server/round_driver.h"
#include "server/metrics.h"
#include "server/metrics_endpoint.h"
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
  using Strand = boost::asio::strand<boost::asio::io_context::executor_type>;

  explicit Server(ServerConfig config);
  void Stop();  // on the core
  void AwaitReload();
  void ReloadCrl();  // on the front, quiesced
  void WatchCrlExpiry();
  void GiveBackMemory();  // on the front, every second

  ServerConfig config_;
  boost::asio::io_context io_;
  Strand core_;   // Coordinator, Connections, Store, signals to stop
  Strand front_;  // Acceptor, SIGHUP, the revocation list
  std::shared_ptr<boost::asio::ssl::context> tls_;
  std::unique_ptr<Store> store_;
  boost::asio::thread_pool worker_{1};  // folds, evaluation, checkpoints: never an I/O thread
  AsioClock clock_{core_};
  BufferBudget budget_;
  Metrics metrics_;  // before everything that counts into it
  std::unique_ptr<RoundDriver> coordinator_;  // Coordinator, or AsyncCoordinator under mode = async
  std::unique_ptr<Connections> connections_;
  std::unique_ptr<Acceptor> acceptor_;
  std::unique_ptr<MetricsEndpoint> metrics_endpoint_;  // with --metrics-listen
  std::unique_ptr<proto::EventFile> events_;           // with --tensorboard
  std::unique_ptr<boost::asio::signal_set> signals_;
  std::unique_ptr<boost::asio::signal_set> reload_;  // SIGHUP
  boost::asio::steady_timer crl_timer_{front_};
  boost::asio::steady_timer trim_timer_{front_};
  uint64_t burst_ = 0;  // the most frames buffered since memory was last given back
  std::chrono::system_clock::time_point crl_next_update_;  // the loaded list's
  uint16_t port_ = 0;
  std::string listening_;  // HOST:PORT, as bound
  bool stopping_ = false;  // on the core
  bool front_stopped_ = false;  // on the front
};

}  // namespace estuary::server
