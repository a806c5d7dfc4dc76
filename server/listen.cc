#include "server/listen.h"

#include "base/host_port.h"

namespace estuary::server {

namespace asio = boost::asio;
using asio::ip::tcp;

Result<tcp::acceptor> ListenOn(asio::any_io_executor executor, const std::string& listen, std::string_view what) {
  std::string host;
  uint16_t port = 0;
  ESTUARY_RETURN_IF_ERROR(ParseHostPort(listen, &host, &port));
  boost::system::error_code ec;
  const auto address = asio::ip::make_address(host, ec);
  if (ec) return InvalidArgument("{} '{}': {} is not an IP address", what, listen, host);
  tcp::acceptor acceptor(executor);
  const tcp::endpoint endpoint(address, port);
  acceptor.open(endpoint.protocol(), ec);
  if (!ec) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor.bind(endpoint, ec);
  if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return IoError("{} {}: cannot listen: {}", what, listen, ec.message());
  return acceptor;
}

}  // namespace estuary::server
