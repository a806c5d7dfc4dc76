// Helpers the secagg tests share.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <vector>

#include "secagg/bytes.h"

namespace estuary::secagg::testing {

inline std::vector<uint8_t> FromHex(std::string_view hex) {
  auto digit = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  std::vector<uint8_t> out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<uint8_t>(digit(hex[i]) * 16 + digit(hex[i + 1])));
  return out;
}

inline Key32 KeyFromHex(std::string_view hex) {
  const std::vector<uint8_t> bytes = FromHex(hex);
  Key32 key{};
  EXPECT_EQ(bytes.size(), key.size()) << hex;
  std::copy_n(bytes.begin(), std::min(bytes.size(), key.size()), key.begin());
  return key;
}

// A fixed key whose bytes are `first`, first + 1, ...: reproducible tests.
inline Key32 CountingKey(uint8_t first) {
  Key32 key;
  for (size_t i = 0; i < key.size(); ++i) key[i] = static_cast<uint8_t>(first + i);
  return key;
}

}  // namespace estuary::secagg::testing
