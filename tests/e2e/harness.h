// Test harness for end-to-end tests: temporary directories, a synthetic
// MNIST-shaped dataset, certificates, the real estuary binaries as child
// processes, and RawClient -- a blocking TLS client that speaks (or breaks)
// the wire protocol frame by frame.
#pragma once

#include <filesystem>
#include <memory>
#include <chrono>
#include <string>
#include <vector>

#include "base/asio.h"
#include "base/status.h"
#include "crypto/tls.h"
#include "estuary.pb.h"

namespace estuary::testing {

namespace fs = std::filesystem;

// A fresh directory removed at the end of the test.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

// Writes the four IDX files of a learnable 10-class problem: each class is a
// bright bar at its own position plus noise.
void WriteSyntheticMnist(const fs::path& dir, int train, int test, uint64_t seed);

fs::path BinaryPath(const std::string& name);  // build/<folder>/<name>

// Runs a command line, returns exit code and combined output.
struct CommandResult {
  int exit_code = -1;
  std::string output;
};
CommandResult RunCommand(const std::string& command_line);

// A port on 127.0.0.1 that was free a moment ago: for a server that must
// come back on the same port after it is killed.
uint16_t FreePort();

// Prints the last `lines` lines of every *.log directly in `dir` to stderr.
void PrintLogTails(const fs::path& dir, size_t lines);

// A child process (estuary-client), killed and reaped when destroyed.
class ChildProcess {
 public:
  ChildProcess(const std::vector<std::string>& argv, const fs::path& log);
  ~ChildProcess();
  // The exit code, or 128 + the signal that ended it. A child still running
  // after `limit` is killed (137) and a line on stderr says so: a test whose
  // child never ends (a server retrying a round that keeps failing, a client
  // reconnecting for ever) fails by itself instead of at ctest's timeout.
  int Wait(std::chrono::seconds limit = std::chrono::seconds(300));
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  std::string program_;
};

class RawClient {
 public:
  using SslStream = boost::asio::ssl::stream<boost::asio::ip::tcp::socket>;
  // Connects and completes the TLS handshake (under TLS 1.3 the client
  // finishes before the server has checked its certificate, so a refusal
  // shows on the first read). cert/key may be empty: no client certificate.
  static Result<std::unique_ptr<RawClient>> Connect(uint16_t port, const crypto::TlsFiles& files);

  Status Send(const v1::Envelope& envelope);
  Status SendBytes(const std::string& bytes);
  // The next frame, or an error once the server closes the connection.
  Result<v1::Envelope> Receive();
  // Hello, then Welcome.
  Status Handshake();
  // Waits for RoundStart and the model chunks that follow it.
  Result<v1::RoundStart> AwaitRound(std::vector<float>* model);
  // True when the server has closed the connection (the next read fails).
  bool Closed();
  // A blocking read or write gives up after `limit` (30 s unless set).
  void SetTimeouts(std::chrono::milliseconds limit);
  void Abort();  // close the socket without a goodbye

 private:
  RawClient() = default;
  boost::asio::io_context io_;
  std::unique_ptr<boost::asio::ssl::context> context_;
  std::unique_ptr<SslStream> stream_;
  std::chrono::milliseconds send_timeout_{30000};  // SetTimeouts'; a write ends after it (SendBytes)
};

// An UpdateBegin for `values` laid out like `start`'s manifest.
v1::Envelope MakeUpdateBegin(const v1::RoundStart& start, const std::vector<float>& values, uint64_t examples);
// The UpdateCommit for a payload of `values`.
v1::Envelope MakeCommit(uint64_t round, const std::vector<float>& values);
v1::Envelope MakeChunk(uint64_t round, uint64_t offset, const void* data, size_t size,
                       v1::DType dtype = v1::DTYPE_F32);

}  // namespace estuary::testing
