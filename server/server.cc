#include "server/server.h"

#include <spdlog/spdlog.h>

#include <chrono>

#include "base/utc.h"
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

}  // namespace

Result<std::unique_ptr<Server>> Server::Create(ServerConfig config) {
  ESTUARY_RETURN_IF_ERROR(config.Finalize());
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
  server->coordinator_ = std::make_unique<Coordinator>(server->config_, *server->store_, server->clock_,
                                                       server->io_.get_executor(), server->worker_.get_executor());
  ESTUARY_RETURN_IF_ERROR(server->coordinator_->Recover());
  server->connections_ = std::make_unique<Connections>(*server->coordinator_, *server->store_);

  std::string host;
  uint16_t port;
  ESTUARY_RETURN_IF_ERROR(ParseHostPort(c.listen, &host, &port));
  boost::system::error_code ec;
  const auto address = asio::ip::make_address(host, ec);
  if (ec) return InvalidArgument("server: listen address '{}': {}", host, ec.message());
  auto acceptor = std::make_unique<tcp::acceptor>(server->io_);
  const tcp::endpoint endpoint(address, port);
  acceptor->open(endpoint.protocol(), ec);
  if (!ec) acceptor->set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor->bind(endpoint, ec);
  if (!ec) acceptor->listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return IoError("server: cannot listen on {}: {}", c.listen, ec.message());
  server->port_ = acceptor->local_endpoint().port();
  server->acceptor_ = std::move(acceptor);
  return server;
}

// The worker's jobs call back into the Coordinator: they end before it does.
Server::~Server() { worker_.join(); }

Status Server::Run() {
  // Read before anything can Stop (and so close) the acceptor: a server
  // resumed after the federation's last round stops at once, below.
  const auto endpoint = acceptor_->local_endpoint();
  signals_ = std::make_unique<asio::signal_set>(io_, SIGINT, SIGTERM);
  signals_->async_wait([this](const boost::system::error_code& ec, int signal) {
    if (!ec) {
      spdlog::info("signal {}: stopping", signal);
      Stop();
    }
  });
  reload_ = std::make_unique<asio::signal_set>(io_, SIGHUP);
  AwaitReload();
  if (!config_.tls.crl.empty()) WatchCrlExpiry();
  if (config_.exit_when_done) {
    coordinator_->set_on_complete([this] { Stop(); });
    if (coordinator_->complete()) Stop();
  }
  fmt::print("listening on {}:{}\n", endpoint.address().to_string(), endpoint.port());
  std::fflush(stdout);
  if (!coordinator_->complete()) spdlog::info("waiting for {} clients to connect", config_.min_clients);
  if (!stopping_) Accept();
  io_.run();
  return Status::Ok();
}

void Server::Accept() {
  acceptor_->async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
    if (stopping_) return;
    if (!ec) {
      boost::system::error_code ignored;
      const auto remote = socket.remote_endpoint(ignored);
      std::string address = remote.address().is_v6() ? fmt::format("[{}]:{}", remote.address().to_string(), remote.port())
                                                      : fmt::format("{}:{}", remote.address().to_string(), remote.port());
      socket.set_option(tcp::no_delay(true), ignored);
      auto session = std::make_shared<Session>(Session::SslStream(std::move(socket), *tls_), std::move(address),
                                               *connections_, config_);
      session->Start();
    } else {
      spdlog::warn("accept: {}", ec.message());
    }
    Accept();
  });
}

void Server::AwaitReload() {
  reload_->async_wait([this](const boost::system::error_code& ec, int) {
    if (ec || stopping_) return;
    ReloadCrl();
    AwaitReload();
  });
}

// On the I/O thread, between handshakes: the swap needs no lock.
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
  connections_->Revoke(*crl);
}

// A server runs for months: the expiry warning is repeated daily, not only
// when the list is loaded.
void Server::WatchCrlExpiry() {
  crl_timer_.expires_after(std::chrono::hours(24));
  crl_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || stopping_) return;
    WarnIfCrlExpires(config_.tls.crl, crl_next_update_);
    WatchCrlExpiry();
  });
}

void Server::Stop() {
  if (stopping_) return;
  stopping_ = true;
  boost::system::error_code ignored;
  acceptor_->close(ignored);
  signals_->cancel(ignored);
  if (reload_) reload_->cancel(ignored);
  crl_timer_.cancel();
  coordinator_->CloseAll();
}

}  // namespace estuary::server
