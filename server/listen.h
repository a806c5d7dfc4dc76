// ListenOn: a TCP acceptor bound and listening on HOST:PORT (port 0: any free
// one), or an error naming `what` (the flag) and the address. The server's
// TLS listener and its metrics endpoint open their sockets with it.
#pragma once

#include <string>
#include <string_view>

#include "base/asio.h"
#include "base/status.h"

namespace estuary::server {

Result<boost::asio::ip::tcp::acceptor> ListenOn(boost::asio::any_io_executor executor, const std::string& listen,
                                                std::string_view what);

}  // namespace estuary::server
