// The headers nearly every test includes, compiled once for all test
// executables (tests/CMakeLists.txt). Parsing them took a third of each test
// file's compile time; a test still includes what it uses, so that it builds
// without this header too (CMAKE_DISABLE_PRECOMPILE_HEADERS=ON).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "base/asio.h"
#include "estuary.pb.h"
