#include "server/server.h"

#include "server/listen.h"

#include <malloc.h>
#include <pthread.h>
#include <sys/resource.h>

#include <spdlog/spdlog.h>

#include <chrono>
#include <thread>
#include <vector>

#include "base/utc.h"
#include "server/async_coordinator.h"
#include "server/coordinator.h"
#include "server/session.h"

namespace estuary::server {

namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

// Past its next update OpenSSL fails every handshake: say so from a week
// before, and loudly after.
void WarnIfCrlExpires(const std::filesystem::path& path, std::chrono::system_clock::time_point next_update) {
  const auto left = next_update - std::chrono::system_clock::now();
  if (left <= std::chrono::seconds(0)) {
    spdlog::error("{}: past its next update {}: every handshake now fails; renew it (estuary-server certs crl) and "
                  "send SIGHUP", path.string(), Utc(next_update));
  } else if (left < std::chrono::hours(24 * 7)) {
    spdlog::warn("{}: next update {} is less than 7 days away; renew it (estuary-server certs crl) and send SIGHUP",
                 path.string(), Utc(next_update));
  }
}

// The list's contents in the log, and the warning above.
void LogCrl(const std::string& what, const std::filesystem::path& path, const crypto::CrlInfo& crl) {
  spdlog::info("{} {}: {} revoked certificate(s), CRL number {}, next update {}", what, path.string(),
               crl.revoked.size(), crl.number, Utc(crl.next_update));
  WarnIfCrlExpires(path, crl.next_update);
}

// Each connection is a descriptor: the soft limit (often 1024) goes up to
// the hard one, which the operator sets.
void RaiseDescriptorLimit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur >= limit.rlim_max) return;
  const rlim_t before = limit.rlim_cur;
  limit.rlim_cur = limit.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &limit) == 0) {
    spdlog::debug("descriptor limit raised from {} to {}", before, limit.rlim_cur);
  }
}

// Frames buffered past this, all sessions together, are given back to the
// system once the burst is over (most of them gone again).
constexpr uint64_t kTrimAfterBytes = 16u << 20;
constexpr auto kTrimCheck = std::chrono::seconds(1);

}  // namespace

Server::Server(ServerConfig config)
    : config_(std::move(config)),
      io_(int(config_.io_threads)),
      core_(asio::make_strand(io_)),
      front_(asio::make_strand(io_)),
      budget_(config_.frame_memory_bytes) {}

Result<std::unique_ptr<Server>> Server::Create(ServerConfig config) {
  ESTUARY_RETURN_IF_ERROR(config.Finalize());
  RaiseDescriptorLimit();
  std::unique_ptr<Server> server(new Server(std::move(config)));
  const ServerConfig& c = server->config_;
  crypto::TlsFiles without_crl = c.tls;
  without_crl.crl.clear();
  ESTUARY_ASSIGN_OR_RETURN(server->tls_, crypto::MakeServerContext(without_crl));
  if (!c.tls.crl.empty()) {
    // Installed as a reload installs it: the file is read once, and what it
    // holds is logged from that one reading.
    ESTUARY_ASSIGN_OR_RETURN(const crypto::CrlInfo crl, crypto::ReloadCrl(*server->tls_, c.tls));
    LogCrl("revocation list", c.tls.crl, crl);
    server->crl_next_update_ = crl.next_update;
  }
  ESTUARY_ASSIGN_OR_RETURN(server->store_, Store::Open(c.db));
  if (c.mode == "async") {
    server->coordinator_ = std::make_unique<AsyncCoordinator>(server->config_, *server->store_, server->clock_,
                                                              server->core_, server->worker_.get_executor());
  } else {
    server->coordinator_ = std::make_unique<Coordinator>(server->config_, *server->store_, server->clock_,
                                                         server->core_, server->worker_.get_executor());
  }
  server->coordinator_->set_metrics(&server->metrics_);
  if (!c.tensorboard.empty()) {
    ESTUARY_ASSIGN_OR_RETURN(server->events_, proto::EventFile::Create(c.tensorboard, "server"));
    server->coordinator_->set_event_file(server->events_.get());
    spdlog::info("tensorboard: {}", server->events_->path().string());
  }
  ESTUARY_RETURN_IF_ERROR(server->coordinator_->Recover());
  server->connections_ = std::make_unique<Connections>(
      *server->coordinator_, *server->store_, server->clock_,
      std::chrono::milliseconds(int64_t(c.event_interval_s * 1000)));

  ESTUARY_ASSIGN_OR_RETURN(tcp::acceptor listener, ListenOn(server->front_, c.listen, "--listen"));
  const tcp::endpoint bound = listener.local_endpoint();
  server->port_ = bound.port();
  server->listening_ = fmt::format("{}:{}", bound.address().to_string(), bound.port());
  Server* self = server.get();
  const Session::Context sessions{server->connections_.get(), server->core_, &server->config_, &server->budget_,
                                  &server->metrics_};
  if (!c.metrics_listen.empty()) {
    ESTUARY_ASSIGN_OR_RETURN(server->metrics_endpoint_,
                             MetricsEndpoint::Create(server->front_, c.metrics_listen, server->metrics_));
  }
  server->acceptor_ = std::make_unique<Acceptor>(server->io_, std::move(listener), server->tls_, sessions, c,
                                                 [self](Event event) {
                                                   asio::post(self->core_, [self, event = std::move(event)] {
                                                     self->connections_->RecordEvent(event);
                                                   });
                                                 });
  return server;
}

// The worker's jobs call back into the Coordinator: they end before it does.
Server::~Server() { worker_.join(); }

Status Server::Run() {
  signals_ = std::make_unique<asio::signal_set>(core_, SIGINT, SIGTERM);
  signals_->async_wait([this](const boost::system::error_code& ec, int signal) {
    if (!ec) {
      spdlog::info("signal {}: stopping", signal);
      Stop();
    }
  });
  reload_ = std::make_unique<asio::signal_set>(front_, SIGHUP);
  AwaitReload();
  if (!config_.tls.crl.empty()) asio::post(front_, [this] { WatchCrlExpiry(); });
  asio::post(front_, [this] { GiveBackMemory(); });
  asio::post(core_, [this] {
    if (config_.exit_when_done) {
      coordinator_->set_on_complete([this] { Stop(); });
      // Resumed after the federation's last round, it stops once the sites
      // have been told (it may have died before they read it).
      if (coordinator_->complete()) return coordinator_->TellLateSites();
    }
    if (!coordinator_->complete()) spdlog::info("waiting for {} clients to connect", config_.min_clients);
  });
  fmt::print("listening on {}\n", listening_);
  if (metrics_endpoint_) fmt::print("metrics on http://{}/metrics\n", metrics_endpoint_->address());
  std::fflush(stdout);
  acceptor_->Start();
  if (metrics_endpoint_) metrics_endpoint_->Start();
  // Named, so that `top -H` and the benchmarks tell the server's threads apart.
  asio::post(worker_, [] { pthread_setname_np(pthread_self(), "estuary-worker"); });
  std::vector<std::thread> threads;
  for (uint32_t i = 1; i < config_.io_threads; ++i) {
    threads.emplace_back([this] {
      pthread_setname_np(pthread_self(), "estuary-io");
      io_.run();
    });
  }
  io_.run();
  for (auto& thread : threads) thread.join();
  return Status::Ok();
}

void Server::AwaitReload() {
  reload_->async_wait([this](const boost::system::error_code& ec, int) {
    if (ec || front_stopped_) return;
    // OpenSSL reads the trust store during handshakes, on any I/O thread:
    // the store is swapped while none runs.
    acceptor_->Quiesce([this] { ReloadCrl(); });
    AwaitReload();
  });
}

void Server::ReloadCrl() {
  if (config_.tls.crl.empty()) {
    spdlog::warn("SIGHUP: no revocation list (--crl) to reload");
    return;
  }
  auto crl = crypto::ReloadCrl(*tls_, config_.tls);
  if (!crl.ok()) {
    spdlog::error("SIGHUP: {}; the revocation list loaded before stays in force", crl.status().message());
    return;
  }
  LogCrl("SIGHUP: reloaded", config_.tls.crl, *crl);
  crl_next_update_ = crl->next_update;
  asio::post(core_, [this, crl = std::move(crl).value()] { connections_->Revoke(crl); });
}

// A server runs for months: the expiry warning is repeated daily, not only
// when the list is loaded.
void Server::WatchCrlExpiry() {
  crl_timer_.expires_after(std::chrono::hours(24));
  crl_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || front_stopped_) return;
    WarnIfCrlExpires(config_.tls.crl, crl_next_update_);
    WatchCrlExpiry();
  });
}

// The process keeps freed buffers for reuse (RetainFreedMemory): after a
// burst of buffered frames, such as many connections each sending a large
// frame at once, what they held goes back to the system instead.
void Server::GiveBackMemory() {
  trim_timer_.expires_after(kTrimCheck);
  trim_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || front_stopped_) return;
    burst_ = std::max(burst_, budget_.TakePeak());
    const uint64_t used = budget_.used();
    if (burst_ >= kTrimAfterBytes && used <= burst_ / 4) {
      malloc_trim(0);
      spdlog::debug("frames buffered peaked at {} MiB, now {} MiB: freed memory given back", burst_ >> 20,
                    used >> 20);
      burst_ = used;
    }
    GiveBackMemory();
  });
}

void Server::Stop() {
  if (stopping_) return;
  stopping_ = true;
  boost::system::error_code ignored;
  signals_->cancel(ignored);
  asio::post(front_, [this] {
    // A handler already due still runs: it finds the flag and arms nothing.
    front_stopped_ = true;
    boost::system::error_code ignored;
    reload_->cancel(ignored);
    crl_timer_.cancel();
    trim_timer_.cancel();
    if (metrics_endpoint_) metrics_endpoint_->Stop();
  });
  acceptor_->Stop();
  connections_->Stop();
  coordinator_->CloseAll();
}

}  // namespace estuary::server
