// The comma-separated lists of flags and metadata ("q,k,v,o", "0,1",
// "art,science"): every comma splits, so an empty item ("a,,b", "a,") comes
// out as an empty string for the caller's validation to name; "" is no item.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace estuary {

inline std::vector<std::string> SplitCommas(std::string_view text) {
  std::vector<std::string> items;
  if (text.empty()) return items;
  while (true) {
    const size_t comma = text.find(',');
    items.emplace_back(text.substr(0, comma));
    if (comma == std::string_view::npos) return items;
    text.remove_prefix(comma + 1);
  }
}

}  // namespace estuary
