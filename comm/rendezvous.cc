#include "comm/rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

// Plain Asio, without base/asio.h's SSL: <utility> first for Boost 1.74 (see there).
#include <utility>

#include <boost/asio.hpp>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/ranges.h>

#include "base/host_port.h"

namespace estuary::comm {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

// The wire of the tcp:// store, one request at a time per connection:
//   request  [u8 op][u32 key bytes][u32 value bytes][key][value]
//   reply    kSet: [u8 1]   kHas: [u8 0|1]   kGet: [u32 value bytes][value], once the key is set
// Integers little-endian. Nothing but rendezvous travels here, so sizes are capped.
enum Op : uint8_t { kSet = 1, kGet = 2, kHas = 3 };
constexpr size_t kMaxKeyBytes = 4 << 10;
constexpr size_t kMaxValueBytes = 16 << 20;

void PutU32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t GetU32(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}

long long Ms(Clock::duration d) { return std::chrono::duration_cast<milliseconds>(d).count(); }

// The table behind rank 0's store; remote waiters are callbacks run on Set.
class Table {
 public:
  using Watcher = std::function<void(const std::string&)>;

  void Set(std::string key, std::string value) {
    std::vector<Watcher> ready;
    {
      std::lock_guard lock(mu_);
      values_[key] = value;
      auto it = watchers_.find(key);
      if (it != watchers_.end()) {
        ready = std::move(it->second);
        watchers_.erase(it);
      }
    }
    changed_.notify_all();
    for (auto& w : ready) w(value);
  }

  // Calls w with the value now if key is set, else when it is.
  void Watch(const std::string& key, Watcher w) {
    std::unique_lock lock(mu_);
    auto it = values_.find(key);
    if (it == values_.end()) {
      watchers_[key].push_back(std::move(w));
      return;
    }
    std::string value = it->second;
    lock.unlock();
    w(value);
  }

  std::optional<std::string> WaitFor(const std::string& key, Clock::time_point deadline) {
    std::unique_lock lock(mu_);
    if (!changed_.wait_until(lock, deadline, [&] { return values_.count(key) > 0; })) return std::nullopt;
    return values_[key];
  }

  bool Has(const std::string& key) {
    std::lock_guard lock(mu_);
    return values_.count(key) > 0;
  }

  // Drops the remote waiters (and the connections they hold) at shutdown.
  void DropWatchers() {
    std::lock_guard lock(mu_);
    watchers_.clear();
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  std::map<std::string, std::string> values_;
  std::map<std::string, std::vector<Watcher>> watchers_;
};

// One client connection to rank 0's server. A malformed request closes it.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, Table& table) : socket_(std::move(socket)), table_(table) {}

  void ReadRequest() {
    asio::async_read(socket_, asio::buffer(head_), [self = shared_from_this()](error_code ec, size_t) {
      if (ec) return;
      const uint32_t key_bytes = GetU32(&self->head_[1]), value_bytes = GetU32(&self->head_[5]);
      const uint8_t op = self->head_[0];
      if (op < kSet || op > kHas || key_bytes > kMaxKeyBytes || value_bytes > kMaxValueBytes ||
          (op != kSet && value_bytes != 0)) {
        self->socket_.close(ec);
        return;
      }
      self->body_.resize(key_bytes + value_bytes);
      asio::async_read(self->socket_, asio::buffer(self->body_), [self](error_code ec, size_t) {
        if (!ec) self->Serve();
      });
    });
  }

 private:
  void Serve() {
    const uint32_t key_bytes = GetU32(&head_[1]);
    std::string key = body_.substr(0, key_bytes);
    switch (head_[0]) {
      case kSet:
        table_.Set(std::move(key), body_.substr(key_bytes));
        Reply(std::string(1, '\1'));
        break;
      case kHas:
        Reply(std::string(1, table_.Has(key) ? '\1' : '\0'));
        break;
      case kGet:
        // The watcher may run on the thread of a local Set: hop back to the socket's executor.
        table_.Watch(key, [self = shared_from_this()](const std::string& value) {
          std::string reply(4, '\0');
          PutU32(reinterpret_cast<uint8_t*>(reply.data()), static_cast<uint32_t>(value.size()));
          reply += value;
          asio::post(self->socket_.get_executor(), [self, reply = std::move(reply)]() mutable {
            self->Reply(std::move(reply));
          });
        });
        break;
    }
  }

  void Reply(std::string bytes) {
    reply_ = std::move(bytes);
    asio::async_write(socket_, asio::buffer(reply_), [self = shared_from_this()](error_code ec, size_t) {
      if (!ec) self->ReadRequest();
    });
  }

  tcp::socket socket_;
  Table& table_;
  std::array<uint8_t, 9> head_{};
  std::string body_;
  std::string reply_;
};

// Rank 0's side of tcp://: the table, served on one thread, and read locally.
class ServingStore final : public Store {
 public:
  explicit ServingStore(std::string address) : address_(std::move(address)), acceptor_(io_) {}

  ~ServingStore() override {
    io_.stop();
    if (thread_.joinable()) thread_.join();
    table_.DropWatchers();
  }

  Status Listen(const std::string& host, uint16_t port) {
    error_code ec;
    auto address = asio::ip::make_address(host, ec);
    if (ec) {
      tcp::resolver resolver(io_);
      auto found = resolver.resolve(host, std::to_string(port), ec);
      if (ec || found.empty()) return IoError("rendezvous {}: cannot resolve '{}': {}", address_, host, ec.message());
      address = found.begin()->endpoint().address();
    }
    const tcp::endpoint endpoint(address, port);
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) return IoError("rendezvous {}: rank 0 cannot serve the store there: {}", address_, ec.message());
    if (port == 0) {  // the kernel's choice, now held: the address says it
      address_ = fmt::format("tcp://{}:{}", host, acceptor_.local_endpoint().port());
    }
    Accept();
    thread_ = std::thread([this] { io_.run(); });
    return Status::Ok();
  }

  Status Set(std::string_view key, std::string_view value) override {
    table_.Set(std::string(key), std::string(value));
    return Status::Ok();
  }
  Result<std::string> Get(std::string_view key, milliseconds timeout) override {
    auto value = table_.WaitFor(std::string(key), Clock::now() + timeout);
    if (!value) return Aborted("rendezvous {}: key '{}' not set within {} ms", address_, key, timeout.count());
    return std::move(*value);
  }
  Result<bool> Has(std::string_view key) override { return table_.Has(std::string(key)); }
  const std::string& address() const override { return address_; }

 private:
  void Accept() {
    acceptor_.async_accept([this](error_code ec, tcp::socket socket) {
      if (ec) return;  // the acceptor closed: shutting down
      socket.set_option(tcp::no_delay(true), ec);
      std::make_shared<Session>(std::move(socket), table_)->ReadRequest();
      Accept();
    });
  }

  std::string address_;  // set once, in the constructor or by Listen on port 0
  asio::io_context io_;
  tcp::acceptor acceptor_;
  Table table_;
  std::thread thread_;
};

// Every other rank's side of tcp://: blocking requests on one connection, each
// bounded by a deadline (the io_context runs only inside a request).
class RemoteStore final : public Store {
 public:
  RemoteStore(std::string address, std::string host, uint16_t port, int rank)
      : address_(std::move(address)), host_(std::move(host)), port_(port), rank_(rank), socket_(io_) {}

  // Connects, retrying while rank 0 is not serving yet.
  Status Connect(Clock::time_point deadline) {
    const auto start = Clock::now();
    error_code ec;
    do {
      tcp::resolver resolver(io_);
      auto endpoints = resolver.resolve(host_, std::to_string(port_), ec);
      if (!ec) {
        ec = Step([&](auto done) { asio::async_connect(socket_, endpoints, [done](error_code e, const tcp::endpoint&) { done(e, 0); }); },
                  deadline);
      }
      if (!ec) {
        socket_.set_option(tcp::no_delay(true), ec);
        connected_ = true;
        return Status::Ok();
      }
      socket_.close();
      // Rank 0 may not listen yet: try again shortly, never past the deadline.
      asio::steady_timer backoff(io_, std::min(deadline, Clock::now() + milliseconds(50)));
      Step([&](auto done) { backoff.async_wait([done](error_code e) { done(e, 0); }); }, deadline + milliseconds(100));
    } while (Clock::now() < deadline);
    return IoError("rendezvous {}: rank {} could not reach rank 0's store within {} ms: {}", address_, rank_,
                   Ms(Clock::now() - start), ec.message());
  }

  Status Set(std::string_view key, std::string_view value) override {
    std::string reply;
    return Request(kSet, key, value, Clock::now() + kRequestTimeout, &reply);
  }
  Result<std::string> Get(std::string_view key, milliseconds timeout) override {
    std::string value;
    ESTUARY_RETURN_IF_ERROR(Request(kGet, key, {}, Clock::now() + timeout, &value));
    return value;
  }
  Result<bool> Has(std::string_view key) override {
    std::string reply;
    ESTUARY_RETURN_IF_ERROR(Request(kHas, key, {}, Clock::now() + kRequestTimeout, &reply));
    return reply == "\1";
  }
  const std::string& address() const override { return address_; }

 private:
  // Bounds requests that rank 0 answers at once.
  static constexpr milliseconds kRequestTimeout{10000};

  // Starts one async operation through start(done) and runs it to completion
  // or to the deadline; on timeout the socket closes and the error is timed_out.
  template <typename Start>
  error_code Step(Start start, Clock::time_point deadline) {
    error_code result;
    bool finished = false;
    start([&](error_code ec, size_t) {
      result = ec;
      finished = true;
    });
    io_.restart();
    while (!finished && io_.run_one_until(deadline) > 0) {
    }
    if (finished) return result;
    error_code ignored;
    socket_.close(ignored);
    io_.restart();
    io_.run();  // lets the cancelled operation finish before its buffers go away
    connected_ = false;
    return asio::error::timed_out;
  }

  Status Request(Op op, std::string_view key, std::string_view value, Clock::time_point deadline,
                 std::string* reply) {
    if (!connected_) ESTUARY_RETURN_IF_ERROR(Connect(deadline));
    std::array<uint8_t, 9> head{op};
    PutU32(&head[1], static_cast<uint32_t>(key.size()));
    PutU32(&head[5], static_cast<uint32_t>(value.size()));
    std::array<asio::const_buffer, 3> out{asio::buffer(head), asio::buffer(key.data(), key.size()),
                                          asio::buffer(value.data(), value.size())};
    error_code ec = Step([&](auto done) { asio::async_write(socket_, out, done); }, deadline);
    std::array<uint8_t, 4> size{};
    if (!ec && op == kGet) {
      ec = Step([&](auto done) { asio::async_read(socket_, asio::buffer(size), done); }, deadline);
      if (!ec) reply->resize(GetU32(size.data()));
    } else if (!ec) {
      reply->resize(1);
    }
    if (!ec && !reply->empty()) {
      ec = Step([&](auto done) { asio::async_read(socket_, asio::buffer(reply->data(), reply->size()), done); },
                deadline);
    }
    if (ec == asio::error::timed_out && op == kGet) {
      return Aborted("rendezvous {}: key '{}' not set within the timeout", address_, key);
    }
    if (ec) {
      const std::string why = ec == asio::error::eof ? "rank 0 closed the connection" : ec.message();
      socket_.close(ec);
      connected_ = false;
      return IoError("rendezvous {}: rank {} lost rank 0's store: {}", address_, rank_, why);
    }
    return Status::Ok();
  }

  const std::string address_, host_;
  const uint16_t port_;
  const int rank_;
  asio::io_context io_;
  tcp::socket socket_;
  bool connected_ = false;
};

// file://: one file per key, written to a temp name and renamed into place so
// a reader never sees half a value. Waiting polls, as inotify does not work on
// the network file systems a multi-node site would share.
class FileStore final : public Store {
 public:
  FileStore(std::string address, std::filesystem::path dir) : address_(std::move(address)), dir_(std::move(dir)) {}

  Status Set(std::string_view key, std::string_view value) override {
    const auto path = PathOf(key);
    auto tmp = path;
    tmp += fmt::format(".tmp{}", ::getpid());
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out.write(value.data(), static_cast<std::streamsize>(value.size()));
      if (!out.flush()) return IoError("rendezvous {}: cannot write {}", address_, tmp.string());
    }
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
    if (ec) return IoError("rendezvous {}: cannot rename {} to {}: {}", address_, tmp.string(), path.string(), ec.message());
    return Status::Ok();
  }

  Result<std::string> Get(std::string_view key, milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    const auto path = PathOf(key);
    for (;;) {
      std::ifstream in(path, std::ios::binary);
      if (in) return std::string(std::istreambuf_iterator<char>(in), {});
      if (Clock::now() >= deadline) break;
      std::this_thread::sleep_for(kPoll);
    }
    return Aborted("rendezvous {}: key '{}' not set within {} ms", address_, key, timeout.count());
  }

  Result<bool> Has(std::string_view key) override {
    std::error_code ec;
    const bool found = std::filesystem::exists(PathOf(key), ec);
    if (ec) return IoError("rendezvous {}: {}", address_, ec.message());
    return found;
  }
  const std::string& address() const override { return address_; }

 private:
  static constexpr milliseconds kPoll{5};

  // Keys become file names: anything but [A-Za-z0-9._-] is escaped as %XX.
  std::filesystem::path PathOf(std::string_view key) const {
    std::string name;
    for (unsigned char c : key) {
      if (std::isalnum(c) || c == '.' || c == '_' || c == '-') {
        name += static_cast<char>(c);
      } else {
        name += fmt::format("%{:02X}", c);
      }
    }
    return dir_ / name;
  }

  const std::string address_;
  const std::filesystem::path dir_;
};

}  // namespace

Result<std::unique_ptr<Store>> OpenStore(const RendezvousOptions& options) {
  const std::string& address = options.address;
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return InvalidArgument("rendezvous {}: rank {} of {} is not a rank", address, options.rank, options.size);
  }
  if (options.timeout.count() <= 0) {
    return InvalidArgument("rendezvous {}: the timeout must be positive", address);
  }
  if (address.starts_with("file://")) {
    std::filesystem::path dir = address.substr(7);
    if (dir.empty() || !dir.is_absolute()) {
      return InvalidArgument("rendezvous '{}': expected file:///absolute/dir", address);
    }
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return IoError("rendezvous {}: cannot create {}: {}", address, dir.string(), ec.message());
    return std::unique_ptr<Store>(std::make_unique<FileStore>(address, dir));
  }
  if (address.starts_with("tcp://")) {
    std::string host;
    uint16_t port = 0;
    ESTUARY_RETURN_IF_ERROR(ParseHostPort(address.substr(6), &host, &port));
    if (port == 0) return InvalidArgument("rendezvous '{}': port 0 cannot be found by the other ranks", address);
    if (options.rank == 0) {
      auto store = std::make_unique<ServingStore>(address);
      ESTUARY_RETURN_IF_ERROR(store->Listen(host, port));
      return std::unique_ptr<Store>(std::move(store));
    }
    auto store = std::make_unique<RemoteStore>(address, host, port, options.rank);
    ESTUARY_RETURN_IF_ERROR(store->Connect(Clock::now() + options.timeout));
    return std::unique_ptr<Store>(std::move(store));
  }
  return InvalidArgument("rendezvous address '{}': expected tcp://HOST:PORT or file:///dir", address);
}

Result<std::unique_ptr<Store>> ServeLoopbackStore() {
  auto store = std::make_unique<ServingStore>("tcp://127.0.0.1:0");
  ESTUARY_RETURN_IF_ERROR(store->Listen("127.0.0.1", 0));
  return std::unique_ptr<Store>(std::move(store));
}

Status AwaitRanks(Store& store, const RendezvousOptions& options, std::string_view scope) {
  const auto start = Clock::now();
  const auto deadline = start + options.timeout;
  auto key = [&](int rank) { return fmt::format("{}.arrived.{}", scope, rank); };
  ESTUARY_RETURN_IF_ERROR(store.Set(key(options.rank), "1"));
  for (int r = 0; r < options.size; ++r) {
    const auto left = std::max(milliseconds(0), std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
    auto got = store.Get(key(r), left);
    if (got.ok()) continue;
    if (got.status().code() != Code::kAborted) {
      // Typically rank 0 gave up first and took the tcp:// store with it.
      return Status(got.status().code(), fmt::format("rendezvous {}: waiting for rank {} of {}: {}", scope, r,
                                                     options.size, got.status().message()));
    }
    // Timed out on rank r: name every rank still missing, not just the first.
    std::vector<int> missing{r};
    for (int q = r + 1; q < options.size; ++q) {
      auto has = store.Has(key(q));
      if (has.ok() && !*has) missing.push_back(q);
    }
    return Aborted("rendezvous {} at {}: rank{} {} of {} did not arrive within {} ms (this is rank {})", scope,
                   store.address(), missing.size() > 1 ? "s" : "", fmt::join(missing, ", "), options.size,
                   options.timeout.count(), options.rank);
  }
  return Status::Ok();
}

Result<std::string> FreeLoopbackRendezvous() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return IoError("rendezvous: socket: {}", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int error = errno;
  close(fd);
  if (!ok) return IoError("rendezvous: no free port on 127.0.0.1: {}", std::strerror(error));
  return fmt::format("tcp://127.0.0.1:{}", ntohs(addr.sin_port));
}

}  // namespace estuary::comm
