// The fuzz targets as plain regression tests: built with the normal compiler
// (no libFuzzer), this main feeds every file under the folders or files it is
// given, in name order, to the target's LLVMFuzzerTestOneInput, so every
// scripts/test (and scripts/sanitize) runs the committed corpus: the seeds and
// every input a fuzzer once crashed on. A failed check aborts, and ctest
// names the target; the input being run is printed first with -v.
//   <target>_regress [-v] PATH...
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int* argc, char*** argv);

namespace {

// The input being run, named when a check aborts or the target crashes.
char current[4096];

void NameInput(int signal) {
  const char head[] = "regress: crashed on ";
  [[maybe_unused]] ssize_t n = write(STDERR_FILENO, head, sizeof head - 1);
  n = write(STDERR_FILENO, current, strnlen(current, sizeof current));
  n = write(STDERR_FILENO, "\n", 1);
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}

}  // namespace

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  bool verbose = false;
  std::vector<fs::path> files;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "-v") == 0) {
      verbose = true;
      continue;
    }
    std::error_code ec;
    if (fs::is_directory(argv[i], ec)) {
      for (const auto& entry : fs::recursive_directory_iterator(argv[i])) {
        if (entry.is_regular_file()) files.push_back(entry.path());
      }
    } else if (fs::is_regular_file(argv[i], ec)) {
      files.emplace_back(argv[i]);
    } else {
      std::fprintf(stderr, "regress: %s: no such file or folder\n", argv[i]);
      return 2;
    }
  }
  if (files.empty()) {
    std::fprintf(stderr, "regress: no inputs (usage: %s [-v] PATH...)\n", argv[0]);
    return 2;
  }
  std::sort(files.begin(), files.end());
  for (int signal : {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL}) std::signal(signal, NameInput);
  for (const fs::path& file : files) {
    std::ifstream in(file, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.good() && !in.eof()) {
      std::fprintf(stderr, "regress: %s: cannot read\n", file.c_str());
      return 2;
    }
    std::snprintf(current, sizeof current, "%s", file.c_str());
    if (verbose) std::fprintf(stderr, "regress: %s (%zu bytes)\n", file.c_str(), bytes.size());
    // A copy of exactly the input's size, so ASan sees a read past its end.
    std::vector<uint8_t> data(bytes.begin(), bytes.end());
    LLVMFuzzerTestOneInput(data.data(), data.size());
  }
  std::printf("regress: %zu inputs ran\n", files.size());
  return 0;
}
