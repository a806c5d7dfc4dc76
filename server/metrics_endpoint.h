// MetricsEndpoint: Metrics (server/metrics.h) over plain HTTP for a
// Prometheus scraper: GET /metrics answers 200 with the text format, any
// other path 404, any other method 405; every connection is closed after its
// one answer. Plain TCP, not TLS: bind it to an address only the monitoring
// network reaches (the default is none: no endpoint without --metrics-listen).
//
// One object per connection, a chain of async handlers holding it by
// shared_from_this, on the executor given; a request larger than 8 KiB or
// slower than 5 seconds is dropped unanswered, so a stalled client holds
// nothing for long.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "base/asio.h"
#include "base/status.h"
#include "server/metrics.h"

namespace estuary::server {

class MetricsEndpoint {
 public:
  // Binds `listen` (HOST:PORT; port 0: any free one). `metrics` must outlive
  // the endpoint.
  static Result<std::unique_ptr<MetricsEndpoint>> Create(boost::asio::any_io_executor executor,
                                                         const std::string& listen, const Metrics& metrics);
  ~MetricsEndpoint();

  void Start();
  void Stop();
  // HOST:PORT as bound.
  const std::string& address() const { return address_; }

 private:
  MetricsEndpoint(boost::asio::ip::tcp::acceptor acceptor, const Metrics& metrics);
  void Accept();

  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer retry_;  // after a failed accept (out of descriptors), a pause before the next
  const Metrics& metrics_;
  std::string address_;
  std::shared_ptr<bool> stopped_ = std::make_shared<bool>(false);
};

}  // namespace estuary::server
