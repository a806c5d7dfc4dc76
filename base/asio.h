// Boost.Asio with SSL. Boost 1.74's awaitable.hpp uses std::exchange without
// including <utility>, which g++ 12 in C++20 mode rejects; include it first.
#pragma once

#include <utility>

#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
