// What the fuzz targets share: inputs made into files for the readers that
// take a path, inputs cut into parts, and the check that stops a run.
//
// Files live in one scratch directory per process (under /dev/shm when there
// is one, so a run costs no disk I/O), rewritten in place on every run.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "base/manifest.h"
#include "base/status.h"

namespace estuary::fuzz {

// A property of the code under test failed: say which and abort, so libFuzzer
// keeps the input as a crash. FUZZ_CHECK(cond) or FUZZ_CHECK(cond, "printf format", args...).
[[noreturn]] inline void Fail(const char* file, int line, const char* condition, const char* format = "", ...) {
  std::fprintf(stderr, "fuzz: %s:%d: check failed: %s", file, line, condition);
  if (*format) {
    std::fputs(": ", stderr);
    va_list args;
    va_start(args, format);
    std::vfprintf(stderr, format, args);
    va_end(args);
  }
  std::fputc('\n', stderr);
  std::abort();
}
#define FUZZ_CHECK(condition, ...) \
  ((condition) ? void(0) : ::estuary::fuzz::Fail(__FILE__, __LINE__, #condition __VA_OPT__(, ) __VA_ARGS__))

// This process's scratch directory, created on first use and removed at exit.
inline const std::filesystem::path& ScratchDir() {
  static const std::filesystem::path dir = [] {
    std::error_code ec;
    std::filesystem::path root = std::filesystem::is_directory("/dev/shm", ec)
                                     ? std::filesystem::path("/dev/shm")
                                     : std::filesystem::temp_directory_path();
    std::string pattern = (root / "estuary-fuzz-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) {
      std::perror("fuzz: cannot create a scratch directory");
      std::abort();
    }
    static const std::string made = pattern;
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(made, ignored);
    });
    return std::filesystem::path(pattern);
  }();
  return dir;
}

// Writes `bytes` to ScratchDir()/name (replacing it) and returns the path.
inline std::filesystem::path WriteScratch(const std::string& name, std::string_view bytes) {
  const std::filesystem::path path = ScratchDir() / name;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    std::perror("fuzz: cannot write a scratch file");
    std::abort();
  }
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) {
      std::perror("fuzz: cannot write a scratch file");
      std::abort();
    }
    done += size_t(n);
  }
  ::close(fd);
  return path;
}

// An input of `count` parts, each but the last preceded by its length as 4
// bytes little-endian (a length past the end takes what is left); the last
// part is the rest. Missing parts are empty. JoinParts writes the format.
inline std::vector<std::string_view> SplitParts(const uint8_t* data, size_t size, size_t count) {
  std::vector<std::string_view> parts;
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  for (size_t i = 0; i + 1 < count; ++i) {
    uint32_t n = 0;
    if (rest.size() >= 4) {
      for (int b = 0; b < 4; ++b) n |= uint32_t(uint8_t(rest[b])) << (8 * b);
      rest.remove_prefix(4);
    } else {
      rest = {};
    }
    const size_t take = n < rest.size() ? n : rest.size();
    parts.push_back(rest.substr(0, take));
    rest.remove_prefix(take);
  }
  parts.push_back(rest);
  return parts;
}

inline std::string JoinParts(const std::vector<std::string>& parts) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i + 1 < parts.size()) {
      const uint32_t n = uint32_t(parts[i].size());
      for (int b = 0; b < 4; ++b) out.push_back(char((n >> (8 * b)) & 0xff));
    }
    out += parts[i];
  }
  return out;
}

// What every refusal must be: one line that says something.
inline void CheckError(const Status& status) {
  FUZZ_CHECK(!status.ok() && !status.message().empty());
  FUZZ_CHECK(status.message().find_first_of("\r\n") == std::string::npos, "not one line: %s",
             status.message().c_str());
}

// What every accepted manifest must be, whoever accepted it: tensors with a
// name and a shape whose element count (computed here without overflow) fits
// in `max_elements`, laid end to end from 0 to total_elements.
inline void CheckAcceptedManifest(const Manifest& manifest, uint64_t max_elements) {
  FUZZ_CHECK(manifest.total_elements <= max_elements, "total_elements %llu over %llu",
             (unsigned long long)manifest.total_elements, (unsigned long long)max_elements);
  uint64_t next = 0;
  for (const TensorSpec& t : manifest.tensors) {
    FUZZ_CHECK(!t.name.empty() && !t.shape.empty());
    uint64_t n = 1;
    for (int64_t d : t.shape) {
      FUZZ_CHECK(d > 0);
      FUZZ_CHECK(!__builtin_mul_overflow(n, uint64_t(d), &n), "tensor '%s': its shape's element count overflows",
                 t.name.c_str());
    }
    FUZZ_CHECK(n == t.numel() && n <= max_elements, "tensor '%s': %llu elements", t.name.c_str(),
               (unsigned long long)n);
    FUZZ_CHECK(t.offset == next);
    FUZZ_CHECK(!__builtin_add_overflow(next, n, &next));
  }
  FUZZ_CHECK(next == manifest.total_elements);
}

}  // namespace estuary::fuzz
