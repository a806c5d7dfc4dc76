#include "server/acceptor.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include <spdlog/spdlog.h>

#include "server/config.h"

namespace estuary::server {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;
using SteadyClock = std::chrono::steady_clock;

namespace {

// How long accepting rests after the process ran out of descriptors.
constexpr auto kExhaustedPause = std::chrono::milliseconds(100);
// Connections shed from the backlog per pause, at most.
constexpr int kShedPerPause = 1024;

int OpenReserve() { return ::open("/dev/null", O_RDONLY | O_CLOEXEC); }

// A reset rather than a goodbye: the peer learns at once, and the server
// keeps no TIME_WAIT entry for a connection it never served.
void Reset(int fd) {
  const linger abort{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &abort, sizeof abort);
  ::close(fd);
}

bool DescriptorsExhausted(const error_code& ec) {
  return ec == asio::error::no_descriptors || ec == asio::error::no_buffer_space || ec == asio::error::no_memory ||
         ec.value() == ENFILE;
}

std::string AddressOf(const tcp::endpoint& remote) {
  return remote.address().is_v6() ? fmt::format("[{}]:{}", remote.address().to_string(), remote.port())
                                  : fmt::format("{}:{}", remote.address().to_string(), remote.port());
}

// What the caps per address count by: an IPv4 address, or an IPv6 one's
// /64, the block one host is given (it may pick any address within it).
std::string PeerKey(const asio::ip::address& address) {
  if (address.is_v4()) return address.to_string();
  const asio::ip::address_v6 v6 = address.to_v6();
  if (v6.is_v4_mapped()) return asio::ip::make_address_v4(asio::ip::v4_mapped, v6).to_string();
  asio::ip::address_v6::bytes_type bytes = v6.to_bytes();
  std::fill(bytes.begin() + 8, bytes.end(), 0);
  return asio::ip::make_address_v6(bytes).to_string() + "/64";
}

}  // namespace

Acceptor::Acceptor(asio::io_context& io, tcp::acceptor listener, std::shared_ptr<asio::ssl::context> tls,
                   const Session::Context& sessions, const ServerConfig& config, std::function<void(Event)> record)
    : io_(io),
      listener_(std::move(listener)),
      tls_(std::move(tls)),
      sessions_(sessions),
      config_(config),
      record_(std::move(record)),
      pause_(listener_.get_executor()),
      flush_(listener_.get_executor()),
      throttle_(std::chrono::milliseconds(int64_t(config.event_interval_s * 1000))),
      reserve_(OpenReserve()) {
  error_code ignored;
  listener_.non_blocking(true, ignored);  // for the shedding accept4 below
}

Acceptor::~Acceptor() {
  if (reserve_ >= 0) ::close(reserve_);
}

void Acceptor::Start() {
  asio::post(listener_.get_executor(), [this] { Accept(); });
}

void Acceptor::Accept() {
  if (stopped_ || accepting_ || !quiesced_.empty()) return;
  accepting_ = true;
  listener_.async_accept(asio::make_strand(io_), [this](const error_code& ec, tcp::socket socket) {
    accepting_ = false;
    OnAccept(ec, std::move(socket));
  });
}

void Acceptor::OnAccept(const error_code& ec, tcp::socket socket) {
  if (stopped_ || ec == asio::error::operation_aborted) return;
  if (ec) {
    if (DescriptorsExhausted(ec)) return OnDescriptorsExhausted(ec);
    spdlog::warn("accept: {}", ec.message());
    return Accept();
  }
  if (exhausted_) {
    exhausted_ = false;
    spdlog::info("accept: descriptors available again; {} connection(s) closed unserved since the last report",
                 exhausted_shed_);
    exhausted_shed_ = 0;
  }
  if (!quiesced_.empty()) {
    held_.push_back(std::move(socket));  // admitted once the quiesced tasks have run
    return;
  }
  Admit(std::move(socket));
  Accept();
}

void Acceptor::Admit(tcp::socket socket) {
  error_code ec;
  const tcp::endpoint remote = socket.remote_endpoint(ec);
  if (ec) return;  // gone already; closing the socket is all there is to do
  const std::string address = AddressOf(remote);
  const std::string host = PeerKey(remote.address());
  uint32_t& from_host = pending_by_host_[host];
  if (pending_.size() >= config_.max_handshakes) {
    if (from_host == 0) pending_by_host_.erase(host);
    return Refuse(std::move(socket), address, host,
                  fmt::format("{} connections are between accept and hello already", pending_.size()));
  }
  if (from_host >= config_.max_handshakes_per_address) {
    return Refuse(std::move(socket), address, host,
                  fmt::format("{} connections from {} are between accept and hello already", from_host, host));
  }
  ++from_host;
  ++handshaking_;
  const uint64_t id = next_id_++;
  socket.set_option(tcp::no_delay(true), ec);
  const auto strand = listener_.get_executor();
  Session::Milestones milestones{
      .handshake_ended = [this, strand, id] { asio::post(strand, [this, id] { OnHandshakeEnded(id); }); },
      .identified = [this, strand, id] { asio::post(strand, [this, id] { OnIdentified(id); }); }};
  auto session = std::make_shared<Session>(Session::SslStream(std::move(socket), *tls_), address, sessions_,
                                           std::move(milestones));
  pending_.emplace(id, Pending{session, host});
  session->Start();
}

void Acceptor::Refuse(tcp::socket socket, const std::string& address, const std::string& host,
                      const std::string& reason) {
  Reset(socket.release());
  if (throttle_.Admit("connection_refused", host, reason, SteadyClock::now())) {
    spdlog::warn("connection from {} closed at once: {}", address, reason);
    record_({NowMs(), "connection_refused", address, reason});
  }
  ArmFlush();
}

void Acceptor::OnDescriptorsExhausted(const error_code& ec) {
  // The reserve descriptor makes room to accept what waits in the backlog
  // and close it, so those peers hear at once instead of timing out.
  if (reserve_ >= 0) {
    ::close(reserve_);
    reserve_ = -1;
  }
  int shed = 0;
  for (int fd; shed < kShedPerPause && (fd = ::accept4(listener_.native_handle(), nullptr, nullptr, SOCK_CLOEXEC)) >= 0;
       ++shed) {
    Reset(fd);
  }
  reserve_ = OpenReserve();  // fails while the process is still out of descriptors; tried again next time
  exhausted_shed_ += uint64_t(shed);
  const auto now = SteadyClock::now();
  if (!exhausted_ || now - exhausted_logged_ >= std::chrono::milliseconds(int64_t(config_.event_interval_s * 1000))) {
    spdlog::error("accept: {}: {} connection(s) closed unserved{}; accepting again every {} ms", ec.message(),
                  exhausted_shed_, exhausted_ ? fmt::format(" in the last {:.0f} s", config_.event_interval_s) : "",
                  kExhaustedPause.count());
    exhausted_logged_ = now;
    exhausted_shed_ = 0;
  }
  exhausted_ = true;
  pause_.expires_after(kExhaustedPause);
  pause_.async_wait([this](const error_code& ec) {
    if (!ec) Accept();
  });
}

void Acceptor::OnHandshakeEnded(uint64_t id) {
  auto it = pending_.find(id);
  if (it == pending_.end() || !it->second.handshaking) return;
  it->second.handshaking = false;
  --handshaking_;
  RunQuiescedTasks();
}

void Acceptor::OnIdentified(uint64_t id) {
  auto it = pending_.find(id);
  if (it == pending_.end()) return;
  if (it->second.handshaking) --handshaking_;  // closed before its handshake ended
  auto host = pending_by_host_.find(it->second.host);
  if (--host->second == 0) pending_by_host_.erase(host);
  pending_.erase(it);
  RunQuiescedTasks();
}

void Acceptor::Quiesce(std::function<void()> task) {
  asio::post(listener_.get_executor(), [this, task = std::move(task)]() mutable {
    if (stopped_) return;
    quiesced_.push_back(std::move(task));
    RunQuiescedTasks();
  });
}

void Acceptor::RunQuiescedTasks() {
  if (quiesced_.empty() || handshaking_ > 0 || stopped_) return;
  auto tasks = std::move(quiesced_);
  quiesced_.clear();
  for (auto& task : tasks) task();
  auto held = std::move(held_);
  held_.clear();
  for (auto& socket : held) Admit(std::move(socket));
  Accept();
}

void Acceptor::ArmFlush() {
  const auto next = throttle_.NextFlush();
  if (flush_armed_ || !next || stopped_) return;
  flush_armed_ = true;
  flush_.expires_at(*next);
  flush_.async_wait([this](const error_code& ec) {
    flush_armed_ = false;
    if (ec || stopped_) return;
    WriteSummaries(throttle_.Flush(SteadyClock::now()));
    ArmFlush();
  });
}

void Acceptor::WriteSummaries(const std::vector<EventThrottle::Summary>& summaries) {
  for (const auto& s : summaries) {
    spdlog::warn("connections closed at once: {} more from {} in the last {:.0f} s; the last: {}", s.count, s.host,
                 s.seconds, s.last_detail);
    record_({NowMs(), s.kind, s.host, s.Describe()});
  }
}

void Acceptor::Stop() {
  asio::post(listener_.get_executor(), [this] {
    if (stopped_) return;
    stopped_ = true;
    error_code ignored;
    listener_.close(ignored);
    pause_.cancel();
    flush_.cancel();
    WriteSummaries(throttle_.FlushAll(SteadyClock::now()));
    quiesced_.clear();
    held_.clear();
    for (auto& [id, pending] : pending_) {
      if (auto session = pending.session.lock()) session->Close();
    }
  });
}

}  // namespace estuary::server
