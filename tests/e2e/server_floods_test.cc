// Floods at the server's front door, by an outsider with no certificate:
// handshakes that cost the server CPU or never finish, descriptors run out,
// refused handshakes replayed. Each test runs the real estuary-server and
// prints what the flood cost it (CPU seconds, log bytes, events written).
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "proto/frame.h"
#include "tests/e2e/attacker.h"
#include "tests/e2e/federation.h"

namespace estuary::testing {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Waits, bounded, until `count` of `connections` were closed by the server
// without an answer; returns how many were.
size_t AwaitClosed(std::vector<PlainConnection>& connections, size_t count, Clock::duration limit) {
  const auto deadline = Clock::now() + limit;
  size_t closed = 0;
  std::vector<bool> seen(connections.size(), false);
  while (closed < count && Clock::now() < deadline) {
    for (size_t i = 0; i < connections.size(); ++i) {
      if (!seen[i] && connections[i].Await(milliseconds(0)) == PlainConnection::State::kClosed) {
        seen[i] = true;
        ++closed;
      }
    }
    if (closed < count) std::this_thread::sleep_for(milliseconds(10));
  }
  return closed;
}

// One address floods the server with replays of a ClientHello offering only
// ffdhe8192 (each costs the server a large key exchange where the group is
// accepted, the flood nothing), another with connections that never speak.
// Beyond 8 from one address they are closed at once, before any TLS; and a
// site from a third address completes its Hello within seconds meanwhile,
// where one I/O thread would have queued it behind every replay.
TEST(ServerFloods, HandshakesBeyondTheCapPerAddressAreClosedAndASiteStillGetsIn) {
  Federation f;
  f.Issue("site-1");
  const uint16_t port = f.StartServer(1, 2, {"--max-handshakes-per-address", "8"});
  ASSERT_NE(port, 0);
  const pid_t pid = f.server().pid();
  auto hello = RecordClientHello("ffdhe8192");
  ASSERT_TRUE(hello.ok()) << hello.status().ToString();
  const double cpu_before = CpuSeconds(pid);

  std::vector<PlainConnection> replays;
  for (int i = 0; i < 100; ++i) {
    auto connection = PlainConnection::Open(port, "127.0.0.3");
    ASSERT_TRUE(connection.ok()) << connection.status().ToString();
    // A connection the server has closed already takes no replay.
    if (connection->Write(*hello).ok()) replays.push_back(std::move(*connection));
  }
  const auto start = Clock::now();
  auto site = RawClient::Connect(port, f.Files("site-1"));
  ASSERT_TRUE(site.ok()) << site.status().ToString();
  ASSERT_TRUE((*site)->Handshake().ok()) << f.ServerLog();
  const double hello_seconds = SecondsSince(start);
  EXPECT_LT(hello_seconds, 5.0) << "a site's handshake and Hello during the flood";

  std::vector<PlainConnection> silent;
  for (int i = 0; i < 100; ++i) {
    auto connection = PlainConnection::Open(port, "127.0.0.2");
    ASSERT_TRUE(connection.ok()) << connection.status().ToString();
    silent.push_back(std::move(*connection));
  }
  EXPECT_EQ(AwaitClosed(silent, 92, seconds(5)), 92u) << "closed at once, beyond 8 pending from 127.0.0.2";
  size_t still_open = 0;
  for (auto& connection : silent) still_open += connection.Await(milliseconds(0)) == PlainConnection::State::kOpen;
  EXPECT_EQ(still_open, 8u) << "the 8 pending ones wait for their handshake's timeout";
  EXPECT_TRUE(f.AwaitLog("connection from 127.0.0.2:")) << f.ServerLog();
  EXPECT_NE(f.ServerLog().find("8 connections from 127.0.0.2 are between accept and hello already"),
            std::string::npos)
      << f.ServerLog();
  std::printf("handshake flood: a site's Hello took %.3f s; the server used %.2f s of CPU\n", hello_seconds,
              CpuSeconds(pid) - cpu_before);
}

// The server runs out of descriptors under a flood of plain connections:
// it neither spins nor fills the log, and serves a site once the flood ends.
TEST(ServerFloods, RunningOutOfDescriptorsNeitherSpinsNorFloodsTheLog) {
  Federation f;
  f.Issue("site-1");
#if defined(__SANITIZE_ADDRESS__)
  // UBSan (built beside ASan) checks a vptr by first testing, through a
  // pipe, that the vtable is readable (sanitizer_common's
  // IsAccessibleMemoryRange). A process out of descriptors has no pipe, so
  // its first virtual call of a type not checked before reads as a bad vptr;
  // and UBSan reads its suppressions only then, when it cannot open them.
  GTEST_SKIP() << "UBSan cannot check a process that has run out of descriptors";
#endif
  const uint16_t port = f.StartServer(1, 2, {"--handshake-timeout", "2"});
  ASSERT_NE(port, 0);
  const pid_t pid = f.server().pid();
  // Room for 30 connections more than the server holds now.
  ASSERT_TRUE(LimitDescriptors(pid, OpenDescriptors(pid) + 30).ok());
  const std::string log = (f.dir() / "server.log").string();
  const uint64_t log_before = FileBytes(log);

  std::vector<PlainConnection> flood;
  for (int i = 0; i < 400; ++i) {
    auto connection = PlainConnection::Open(port, "127.0.0.2");
    if (connection.ok()) flood.push_back(std::move(*connection));
  }
  ASSERT_TRUE(f.AwaitLog("Too many open files", seconds(10))) << f.ServerLog().substr(0, 4000);
  // The measurement: what two seconds out of descriptors cost.
  const double cpu_before = CpuSeconds(pid);
  std::this_thread::sleep_for(seconds(2));
  const double cpu = CpuSeconds(pid) - cpu_before;
  const uint64_t logged = FileBytes(log) - log_before;
  EXPECT_LT(cpu, 0.4) << "CPU seconds in 2 s out of descriptors";
  EXPECT_LT(logged, 16u << 10) << "log bytes";

  flood.clear();
  // Served again once its pending handshakes have ended (2 s).
  const auto deadline = Clock::now() + seconds(15);
  Status served = Aborted("not tried");
  while (!served.ok() && Clock::now() < deadline) {
    auto site = RawClient::Connect(port, f.Files("site-1"));
    served = site.ok() ? (*site)->Handshake() : site.status();
    if (!served.ok()) std::this_thread::sleep_for(milliseconds(100));
  }
  EXPECT_TRUE(served.ok()) << served.ToString() << "\n" << f.ServerLog().substr(0, 4000);
  std::printf("descriptor flood: %.2f s of CPU and %llu log bytes in 2 s out of descriptors\n", cpu,
              static_cast<unsigned long long>(logged));
}

// 500 refused handshakes from one address (a client without a certificate)
// leave a few rows and log lines that still account for all 500.
TEST(ServerFloods, RefusedHandshakesFromOneAddressAreWrittenInAggregate) {
  Federation f;
  f.Issue("site-1");
  const uint16_t port = f.StartServer(1, 2, {"--event-interval", "1"});
  ASSERT_NE(port, 0);
  const crypto::TlsFiles no_certificate{{}, {}, f.certs() / "ca.pem"};
  for (int i = 0; i < 500; ++i) {
    auto client = RawClient::Connect(port, no_certificate);
    // TLS 1.3: the refusal arrives as an alert on the first read.
    if (client.ok()) {
      ASSERT_FALSE((*client)->Handshake().ok());
    }
  }
  // The last summary is written when its interval (1 s) ends.
  auto refused = [&] {
    uint64_t total = 0, rows = 0;
    auto store = server::Store::OpenReadOnly(f.db());
    if (!store.ok()) return std::pair{total, rows};
    auto events = (*store)->Events(10000);
    if (!events.ok()) return std::pair{total, rows};
    for (const auto& e : *events) {
      if (e.kind != "handshake_refused") continue;
      ++rows;
      // A summary: "N more in the last T s; the last: ..."
      const auto more = e.detail.find(" more in the last ");
      total += more == std::string::npos ? 1 : std::stoull(e.detail.substr(0, more));
    }
    return std::pair{total, rows};
  };
  const auto deadline = Clock::now() + seconds(10);
  while (refused().first < 500 && Clock::now() < deadline) std::this_thread::sleep_for(milliseconds(50));
  const auto [total, rows] = refused();
  EXPECT_EQ(total, 500u);
  EXPECT_LE(rows, 10u);
  const std::string server_log = f.ServerLog();
  size_t lines = 0;
  for (size_t at = 0; (at = server_log.find("handshake refused", at)) != std::string::npos; ++at) ++lines;
  EXPECT_EQ(lines, rows) << "one log line per row";
  std::printf("500 refused handshakes: %llu rows and %zu log lines\n", static_cast<unsigned long long>(rows), lines);
}

}  // namespace
}  // namespace estuary::testing
