// Attacker: what the server-limit tests do to a running estuary-server, and
// how they watch it: plain TCP connections from a chosen loopback address,
// a recorded TLS ClientHello to replay, and the server process's CPU time,
// resident memory and descriptors read from /proc.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "base/status.h"
#include "estuary.pb.h"

namespace estuary::testing {

// A TCP connection to 127.0.0.1:port from `source` (any 127.x.y.z address
// is this host's, so a test can play a second peer); closed when destroyed.
class PlainConnection {
 public:
  static Result<PlainConnection> Open(uint16_t port, const std::string& source = "127.0.0.1");
  PlainConnection(PlainConnection&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  PlainConnection& operator=(PlainConnection&& other) noexcept;
  ~PlainConnection();

  Status Write(const std::string& bytes);
  enum class State { kOpen, kAnswered, kClosed };
  // kClosed: the server closed it (end of stream or reset) without sending a
  // byte; kAnswered: it sent something; kOpen: neither within `wait`.
  State Await(std::chrono::milliseconds wait);
  int fd() const { return fd_; }

 private:
  explicit PlainConnection(int fd) : fd_(fd) {}
  int fd_ = -1;
};

// The bytes of a TLS 1.3 ClientHello that offers only `groups` (OpenSSL's
// names, "ffdhe8192"), recorded once from an OpenSSL client on memory BIOs:
// replayed, it makes a server do its side of the key exchange for free.
Result<std::string> RecordClientHello(const std::string& groups);

// What /proc says of a process.
double CpuSeconds(pid_t pid);         // user + system
uint64_t ResidentBytes(pid_t pid);    // VmRSS
size_t OpenDescriptors(pid_t pid);    // entries of /proc/PID/fd
uint64_t FileBytes(const std::string& path);

// Lowers the descriptor limit of a running process (prlimit), soft and hard.
Status LimitDescriptors(pid_t pid, uint64_t limit);

// The largest resident size of a process while it lives: /proc sampled
// every millisecond on a thread of its own.
class PeakResident {
 public:
  explicit PeakResident(pid_t pid);
  ~PeakResident();
  uint64_t peak() const { return peak_.load(); }

 private:
  std::atomic<uint64_t> peak_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// The frames a site sends as raw bytes: `count` frames of `envelope`, back
// to back.
std::string Frames(const v1::Envelope& envelope, size_t count);
// A Heartbeat padded with `padding` bytes in a field this protocol does not
// define, which protobuf keeps when it parses and writes when it serializes.
v1::Envelope PaddedHeartbeat(size_t padding);
// A frame header announcing `size` bytes.
std::string FrameHeader(uint32_t size);

}  // namespace estuary::testing
