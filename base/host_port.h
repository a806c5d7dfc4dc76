// "HOST:PORT" and "[IPV6]:PORT" addresses, as the three programs take them.
#pragma once

#include <charconv>
#include <cstdint>
#include <string>

#include "base/status.h"

namespace estuary {

inline Status ParseHostPort(const std::string& text, std::string* host, uint16_t* port) {
  std::string h, p;
  if (!text.empty() && text.front() == '[') {
    const auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return InvalidArgument("address '{}': expected [IPV6]:PORT", text);
    }
    h = text.substr(1, close - 1);
    p = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos || colon == 0) return InvalidArgument("address '{}': expected HOST:PORT", text);
    h = text.substr(0, colon);
    p = text.substr(colon + 1);
  }
  unsigned value = 0;
  auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), value);
  if (ec != std::errc() || end != p.data() + p.size() || value > 65535) {
    return InvalidArgument("address '{}': bad port '{}'", text, p);
  }
  *host = h;
  *port = static_cast<uint16_t>(value);
  return Status::Ok();
}

}  // namespace estuary
