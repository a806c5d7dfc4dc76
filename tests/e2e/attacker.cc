#include "tests/e2e/attacker.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "proto/frame.h"

namespace estuary::testing {

Result<PlainConnection> PlainConnection::Open(uint16_t port, const std::string& source) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return IoError("plain connection: socket: {}", std::strerror(errno));
  PlainConnection connection(fd);
  sockaddr_in local{};
  local.sin_family = AF_INET;
  if (inet_pton(AF_INET, source.c_str(), &local.sin_addr) != 1) {
    return InvalidArgument("plain connection: '{}' is not an IPv4 address", source);
  }
  if (::bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof local) != 0) {
    return IoError("plain connection: bind {}: {}", source, std::strerror(errno));
  }
  sockaddr_in server{};
  server.sin_family = AF_INET;
  server.sin_port = htons(port);
  server.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&server), sizeof server) != 0) {
    return IoError("plain connection: connect from {}: {}", source, std::strerror(errno));
  }
  return connection;
}

PlainConnection& PlainConnection::operator=(PlainConnection&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

PlainConnection::~PlainConnection() {
  if (fd_ >= 0) ::close(fd_);
}

Status PlainConnection::Write(const std::string& bytes) {
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::send(fd_, bytes.data() + written, bytes.size() - written, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Aborted("plain connection: write: {}", std::strerror(errno));
    }
    written += size_t(n);
  }
  return Status::Ok();
}

PlainConnection::State PlainConnection::Await(std::chrono::milliseconds wait) {
  pollfd p{fd_, POLLIN, 0};
  int ready;
  do {
    ready = ::poll(&p, 1, int(wait.count()));
  } while (ready < 0 && errno == EINTR);
  if (ready <= 0) return State::kOpen;
  char byte;
  const ssize_t n = ::recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n > 0 ? State::kAnswered : State::kClosed;
}

Result<std::string> RecordClientHello(const std::string& groups) {
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> context(SSL_CTX_new(TLS_client_method()), SSL_CTX_free);
  if (!context) return Internal("client hello: SSL_CTX_new failed");
  SSL_CTX_set_min_proto_version(context.get(), TLS1_3_VERSION);
  if (SSL_CTX_set1_groups_list(context.get(), groups.c_str()) != 1) {
    ERR_clear_error();
    return InvalidArgument("client hello: OpenSSL does not know the groups '{}'", groups);
  }
  std::unique_ptr<SSL, decltype(&SSL_free)> ssl(SSL_new(context.get()), SSL_free);
  BIO* in = BIO_new(BIO_s_mem());
  BIO* out = BIO_new(BIO_s_mem());
  SSL_set_bio(ssl.get(), in, out);  // the SSL owns both
  SSL_set_connect_state(ssl.get());
  const int rc = SSL_do_handshake(ssl.get());
  if (rc == 1 || SSL_get_error(ssl.get(), rc) != SSL_ERROR_WANT_READ) {
    ERR_clear_error();
    return Internal("client hello: the handshake did not stop for the server's answer");
  }
  char* data = nullptr;
  const long size = BIO_get_mem_data(out, &data);
  if (size <= 0) return Internal("client hello: nothing was written");
  return std::string(data, size_t(size));
}

double CpuSeconds(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat((std::istreambuf_iterator<char>(in)), {});
  // The command name may hold spaces: fields count from after its ')'.
  const auto close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream fields(stat.substr(close + 2));
  std::string field;
  uint64_t utime = 0, stime = 0;
  for (int i = 3; fields >> field; ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) {
      stime = std::stoull(field);
      break;
    }
  }
  return double(utime + stime) / double(sysconf(_SC_CLK_TCK));
}

uint64_t ResidentBytes(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/status", pid));
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;  // kB
  }
  return 0;
}

size_t OpenDescriptors(pid_t pid) {
  std::error_code ec;
  size_t n = 0;
  for (auto it = std::filesystem::directory_iterator(fmt::format("/proc/{}/fd", pid), ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return n;
}

uint64_t FileBytes(const std::string& path) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  return ec ? 0 : uint64_t(size);
}

Status LimitDescriptors(pid_t pid, uint64_t limit) {
  const rlimit lowered{limit, limit};
  if (::prlimit(pid, RLIMIT_NOFILE, &lowered, nullptr) != 0) {
    return IoError("prlimit {} RLIMIT_NOFILE {}: {}", pid, limit, std::strerror(errno));
  }
  return Status::Ok();
}

PeakResident::PeakResident(pid_t pid)
    : thread_([this, pid] {
        while (!stop_.load()) {
          const uint64_t now = ResidentBytes(pid);
          if (now > peak_.load()) peak_.store(now);
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      }) {}

PeakResident::~PeakResident() {
  stop_.store(true);
  thread_.join();
}

std::string Frames(const v1::Envelope& envelope, size_t count) {
  const proto::Frame frame = proto::EncodeFrame(envelope);
  std::string bytes;
  bytes.reserve(frame.size() * count);
  for (size_t i = 0; i < count; ++i) bytes.append(reinterpret_cast<const char*>(frame.data()), frame.size());
  return bytes;
}

v1::Envelope PaddedHeartbeat(size_t padding) {
  v1::Heartbeat heartbeat;
  heartbeat.set_sent_unix_ms(1);
  // Field 15, length-delimited: tag 15 << 3 | 2, the length as a varint.
  std::string bytes = heartbeat.SerializeAsString();
  bytes.push_back(char(15 << 3 | 2));
  for (uint64_t n = padding; ; n >>= 7) {
    if (n < 0x80) {
      bytes.push_back(char(n));
      break;
    }
    bytes.push_back(char((n & 0x7f) | 0x80));
  }
  bytes.append(padding, 'x');
  v1::Envelope envelope;
  envelope.mutable_heartbeat()->ParseFromString(bytes);
  return envelope;
}

std::string FrameHeader(uint32_t size) {
  return {char(size >> 24), char(size >> 16 & 0xff), char(size >> 8 & 0xff), char(size & 0xff)};
}

}  // namespace estuary::testing
