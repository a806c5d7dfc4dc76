#include "tests/e2e/harness.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>

#include "crypto/transfer_digest.h"
#include "models/dataset.h"
#include "proto/frame.h"

extern char** environ;

namespace estuary::testing {

namespace asio = boost::asio;

TempDir::TempDir() {
  std::string pattern = (fs::temp_directory_path() / "estuary-test-XXXXXX").string();
  path_ = mkdtemp(pattern.data());
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

void WriteSyntheticMnist(const fs::path& dir, int train_size, int test_size, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto make = [&](int n) {
    models::Dataset d;
    d.feature_size = 784;
    d.features.resize(size_t(n) * 784);
    d.labels.resize(n);
    for (int i = 0; i < n; ++i) {
      const int label = int(rng() % 10);
      d.labels[i] = label;
      for (int p = 0; p < 784; ++p) {
        const int row = p / 28;
        const float bar = (row >= 2 + 2 * label && row < 4 + 2 * label) ? 0.8f : 0.0f;
        d.features[size_t(i) * 784 + p] = std::min(1.0f, bar + float(rng() % 64) / 255.0f);
      }
    }
    return d;
  };
  fs::create_directories(dir);
  const auto train = make(train_size);
  const auto test = make(test_size);
  Status written = models::WriteIdx(dir, train, test);
  if (!written.ok()) throw std::runtime_error(written.ToString());
}

fs::path BinaryPath(const std::string& name) {
  const fs::path build = ESTUARY_BINARY_DIR;
  for (const char* folder : {"server", "client", "simulations"}) {
    if (fs::exists(build / folder / name)) return build / folder / name;
  }
  return build / name;
}

uint16_t FreePort() {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor acceptor(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
  return acceptor.local_endpoint().port();
}

CommandResult RunCommand(const std::string& command_line) {
  CommandResult result;
  FILE* pipe = popen((command_line + " 2>&1").c_str(), "r");
  if (!pipe) return result;
  std::array<char, 4096> buffer;
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) result.output.append(buffer.data(), n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

ChildProcess::ChildProcess(const std::vector<std::string>& argv, const fs::path& log) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  std::vector<std::string> copy = argv;
  std::vector<char*> args;
  for (auto& a : copy) args.push_back(a.data());
  args.push_back(nullptr);
  program_ = argv.empty() ? std::string() : argv[0];
  if (posix_spawn(&pid_, args[0], &actions, nullptr, args.data(), environ) != 0) pid_ = -1;
  posix_spawn_file_actions_destroy(&actions);
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    Wait();
  }
}

void PrintLogTails(const fs::path& dir, size_t lines) {
  std::error_code ec;
  std::vector<fs::path> logs;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.path().extension() == ".log") logs.push_back(entry.path());
  }
  std::sort(logs.begin(), logs.end());
  for (const fs::path& log : logs) {
    std::ifstream in(log);
    std::deque<std::string> tail;
    for (std::string line; std::getline(in, line);) {
      tail.push_back(std::move(line));
      if (tail.size() > lines) tail.pop_front();
    }
    std::fprintf(stderr, "---- %s (last %zu lines) ----\n", log.filename().c_str(), tail.size());
    for (const std::string& line : tail) std::fprintf(stderr, "%s\n", line.c_str());
  }
}

int ChildProcess::Wait(std::chrono::seconds limit) {
  if (pid_ <= 0) return -1;
  // A pidfd becomes readable when the child exits: a wait with a deadline.
  if (const int fd = int(syscall(SYS_pidfd_open, pid_, 0)); fd >= 0) {
    pollfd child{fd, POLLIN, 0};
    int ready;
    do {
      ready = poll(&child, 1, int(std::chrono::milliseconds(limit).count()));
    } while (ready < 0 && errno == EINTR);
    close(fd);
    if (ready == 0) {
      std::fprintf(stderr, "harness: %s (pid %d) still running after %lld s: killed\n", program_.c_str(), int(pid_),
                   static_cast<long long>(limit.count()));
      kill(pid_, SIGKILL);
    }
  }
  int status;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

Result<std::unique_ptr<RawClient>> RawClient::Connect(uint16_t port, const crypto::TlsFiles& files) {
  std::unique_ptr<RawClient> client(new RawClient());
  client->context_ = std::make_unique<asio::ssl::context>(asio::ssl::context::tls_client);
  SSL_CTX_set_min_proto_version(client->context_->native_handle(), TLS1_3_VERSION);
  boost::system::error_code ec;
  client->context_->load_verify_file(files.ca.string(), ec);
  if (ec) return IoError("raw client: {}: {}", files.ca.string(), ec.message());
  client->context_->set_verify_mode(asio::ssl::verify_peer);
  if (!files.cert.empty()) {
    client->context_->use_certificate_chain_file(files.cert.string(), ec);
    if (!ec) client->context_->use_private_key_file(files.key.string(), asio::ssl::context::pem, ec);
    if (ec) return IoError("raw client: {}: {}", files.cert.string(), ec.message());
  }
  client->stream_ = std::make_unique<SslStream>(client->io_, *client->context_);
  auto& socket = client->stream_->lowest_layer();
  socket.connect({asio::ip::make_address("127.0.0.1"), port}, ec);
  if (ec) return IoError("raw client: connect: {}", ec.message());
  // Every blocking read gives up after 30 s, so a broken server fails the test instead of hanging it.
  timeval timeout{30, 0};
  setsockopt(socket.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  setsockopt(socket.native_handle(), SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  client->stream_->handshake(asio::ssl::stream_base::client, ec);
  if (ec) return Aborted("raw client: handshake: {}", ec.message());
  return client;
}

Status RawClient::SendBytes(const std::string& bytes) {
  // SO_SNDTIMEO alone does not end a write the peer does not read: when
  // send() times out, Asio polls the socket on without a limit. A write that
  // outlasts the send timeout has the sending side shut under it instead.
  std::mutex mutex;
  std::condition_variable written;
  bool done = false;
  std::thread watchdog([&, fd = stream_->lowest_layer().native_handle()] {
    std::unique_lock lock(mutex);
    if (!written.wait_for(lock, send_timeout_, [&] { return done; })) ::shutdown(fd, SHUT_WR);
  });
  boost::system::error_code ec;
  asio::write(*stream_, asio::buffer(bytes), ec);
  {
    std::lock_guard lock(mutex);
    done = true;
  }
  written.notify_one();
  watchdog.join();
  if (ec) return Aborted("raw client: write: {}", ec.message());
  return Status::Ok();
}

Status RawClient::Send(const v1::Envelope& envelope) {
  const proto::Frame frame = proto::EncodeFrame(envelope);
  return SendBytes(std::string(reinterpret_cast<const char*>(frame.data()), frame.size()));
}

Result<v1::Envelope> RawClient::Receive() {
  std::array<uint8_t, 4> header;
  boost::system::error_code ec;
  asio::read(*stream_, asio::buffer(header), ec);
  if (ec) return Aborted("raw client: read: {}", ec.message());
  ESTUARY_ASSIGN_OR_RETURN(uint32_t size, proto::ParseFrameHeader(header, 1u << 30));
  std::vector<uint8_t> body(size);
  asio::read(*stream_, asio::buffer(body), ec);
  if (ec) return Aborted("raw client: read: {}", ec.message());
  return proto::ParseEnvelope(body.data(), body.size());
}

Status RawClient::Handshake() {
  v1::Envelope hello;
  hello.mutable_hello()->set_protocol_version(proto::kProtocolVersion);
  hello.mutable_hello()->set_num_examples(10);
  ESTUARY_RETURN_IF_ERROR(Send(hello));
  ESTUARY_ASSIGN_OR_RETURN(auto welcome, Receive());
  if (!welcome.has_welcome()) return ProtocolError("raw client: expected welcome, got {}", proto::BodyName(welcome));
  return Status::Ok();
}

Result<v1::RoundStart> RawClient::AwaitRound(std::vector<float>* model) {
  for (;;) {
    ESTUARY_ASSIGN_OR_RETURN(auto envelope, Receive());
    if (!envelope.has_round_start()) continue;
    const auto start = envelope.round_start();
    model->assign(start.manifest().total_elements(), 0.0f);
    uint64_t received = 0;
    while (start.model_follows() && received < model->size() * sizeof(float)) {
      ESTUARY_ASSIGN_OR_RETURN(auto chunk, Receive());
      if (!chunk.has_model_chunk()) continue;
      std::memcpy(reinterpret_cast<char*>(model->data()) + chunk.model_chunk().offset(),
                  chunk.model_chunk().data().data(), chunk.model_chunk().data().size());
      received += chunk.model_chunk().data().size();
    }
    return start;
  }
}

bool RawClient::Closed() {
  for (;;) {
    auto envelope = Receive();
    if (!envelope.ok()) return true;
    if (envelope->has_heartbeat() || envelope->has_round_closed()) continue;
    return false;
  }
}

void RawClient::SetTimeouts(std::chrono::milliseconds limit) {
  const int fd = stream_->lowest_layer().native_handle();
  timeval timeout{time_t(limit.count() / 1000), suseconds_t(limit.count() % 1000 * 1000)};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  send_timeout_ = limit;
}

void RawClient::Abort() {
  boost::system::error_code ec;
  // shutdown, not just close: a child process spawned since may hold a copy of the descriptor.
  stream_->lowest_layer().shutdown(boost::asio::socket_base::shutdown_both, ec);
  stream_->lowest_layer().close(ec);
}

v1::Envelope MakeUpdateBegin(const v1::RoundStart& start, const std::vector<float>& values, uint64_t examples) {
  v1::Envelope envelope;
  auto* begin = envelope.mutable_update_begin();
  begin->set_round(start.round());
  begin->set_kind(v1::UPDATE_FULL);
  begin->set_num_examples(examples);
  begin->set_train_loss(1.0);
  *begin->mutable_manifest() = start.manifest();
  return envelope;
}

v1::Envelope MakeCommit(uint64_t round, const std::vector<float>& values) {
  v1::Envelope envelope;
  envelope.mutable_update_commit()->set_round(round);
  envelope.mutable_update_commit()->set_digest(crypto::TransferDigestHex(values.data(), values.size() * sizeof(float)));
  return envelope;
}

v1::Envelope MakeChunk(uint64_t round, uint64_t offset, const void* data, size_t size, v1::DType dtype) {
  v1::Envelope envelope;
  auto* chunk = envelope.mutable_update_chunk();
  chunk->set_round(round);
  chunk->set_offset(offset);
  chunk->set_dtype(dtype);
  chunk->set_data(static_cast<const char*>(data), size);
  return envelope;
}

}  // namespace estuary::testing
