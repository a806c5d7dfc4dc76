// The text files the torch fixtures of tests/aggregation write: a header
// line, then one line per record, "tag value value ...". ReadOracleFile hands
// each line's tag and the rest of it to a reader, which returns false for a
// tag it does not know; every failure names the file, and the tag.
#pragma once

#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace estuary::aggregation::testing {

// count values of the line, read as double and stored as T.
template <typename T>
std::vector<T> ReadValues(std::istringstream& line, size_t count) {
  std::vector<T> values(count);
  for (T& v : values) {
    double d = 0;
    line >> d;
    v = T(d);
  }
  return values;
}

// fixture: the ctest fixture that writes the file, for the message when it is missing.
inline bool ReadOracleFile(const std::string& path, const std::string& header, const std::string& fixture,
                           const std::function<bool(const std::string& tag, std::istringstream& line)>& read,
                           std::string& error) {
  std::ifstream in(path);
  if (!in) {
    error = path + ": cannot open; run via ctest so the " + fixture + " fixture writes it";
    return false;
  }
  std::string text, tag;
  std::getline(in, text);
  if (text != header) {
    error = path + ": bad header '" + text + "'";
    return false;
  }
  while (std::getline(in, text)) {
    std::istringstream line(text);
    line >> tag;
    if (!read(tag, line)) {
      error = path + ": unexpected line tag '" + tag + "'";
      return false;
    }
    if (line.fail()) {
      error = path + ": malformed '" + tag + "' line";
      return false;
    }
  }
  return true;
}

}  // namespace estuary::aggregation::testing
