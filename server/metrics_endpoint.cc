#include "server/metrics_endpoint.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <chrono>

#include "server/listen.h"

namespace estuary::server {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

namespace {

constexpr size_t kMaxRequestBytes = 8 << 10;
constexpr auto kRequestTimeout = std::chrono::seconds(5);

// One scrape: read the request head, write one answer, close.
class MetricsConnection : public std::enable_shared_from_this<MetricsConnection> {
 public:
  MetricsConnection(tcp::socket socket, const Metrics& metrics)
      : socket_(std::move(socket)), timer_(socket_.get_executor()), request_(kMaxRequestBytes), metrics_(metrics) {}

  void Start() {
    timer_.expires_after(kRequestTimeout);
    timer_.async_wait([self = shared_from_this()](const error_code& ec) {
      if (!ec) self->Close();
    });
    asio::async_read_until(socket_, request_, "\r\n\r\n",
                           [self = shared_from_this()](const error_code& ec, size_t) { self->OnRequest(ec); });
  }

 private:
  void OnRequest(const error_code& ec) {
    if (ec) return Close();  // too large, too slow, or gone: no answer
    std::istream in(&request_);
    std::string method, target;
    in >> method >> target;
    if (method != "GET" && method != "HEAD") {
      return Answer("405 Method Not Allowed", "text/plain", "only GET\n", method == "HEAD");
    }
    if (target != "/metrics") return Answer("404 Not Found", "text/plain", "see /metrics\n", method == "HEAD");
    Answer("200 OK", "text/plain; version=0.0.4; charset=utf-8", metrics_.Render(), method == "HEAD");
  }

  void Answer(const char* status, const char* type, const std::string& body, bool head_only) {
    response_ = fmt::format("HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
                            status, type, body.size(), head_only ? "" : body);
    asio::async_write(socket_, asio::buffer(response_),
                      [self = shared_from_this()](const error_code&, size_t) { self->Close(); });
  }

  void Close() {
    timer_.cancel();
    error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

  tcp::socket socket_;
  asio::steady_timer timer_;
  asio::streambuf request_;
  std::string response_;
  const Metrics& metrics_;
};

}  // namespace

Result<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Create(asio::any_io_executor executor,
                                                                 const std::string& listen, const Metrics& metrics) {
  ESTUARY_ASSIGN_OR_RETURN(tcp::acceptor acceptor, ListenOn(executor, listen, "--metrics-listen"));
  std::unique_ptr<MetricsEndpoint> endpoint_owner(new MetricsEndpoint(std::move(acceptor), metrics));
  const tcp::endpoint bound = endpoint_owner->acceptor_.local_endpoint();
  endpoint_owner->address_ = fmt::format("{}:{}", bound.address().to_string(), bound.port());
  return endpoint_owner;
}

MetricsEndpoint::MetricsEndpoint(tcp::acceptor acceptor, const Metrics& metrics)
    : acceptor_(std::move(acceptor)), retry_(acceptor_.get_executor()), metrics_(metrics) {}

MetricsEndpoint::~MetricsEndpoint() { *stopped_ = true; }

void MetricsEndpoint::Start() { Accept(); }

void MetricsEndpoint::Stop() {
  *stopped_ = true;
  retry_.cancel();
  error_code ignored;
  acceptor_.close(ignored);
}

void MetricsEndpoint::Accept() {
  acceptor_.async_accept([this, stopped = stopped_](const error_code& ec, tcp::socket socket) {
    if (*stopped) return;
    if (!ec) {
      std::make_shared<MetricsConnection>(std::move(socket), metrics_)->Start();
      return Accept();
    }
    spdlog::debug("metrics endpoint: accept: {}", ec.message());
    retry_.expires_after(std::chrono::milliseconds(100));
    retry_.async_wait([this, stopped](const error_code& wait) {
      if (!wait && !*stopped) Accept();
    });
  });
}

}  // namespace estuary::server
