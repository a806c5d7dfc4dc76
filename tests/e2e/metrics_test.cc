// The server's Prometheus endpoint (--metrics-listen), scraped over real
// HTTP on loopback before, during and after a federation of two real sites
// over TLS: every sample in the text format, the counts the federation
// implies, and the refusals of other paths and methods.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <csignal>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "base/asio.h"
#include "server/store.h"
#include "simulations/server_process.h"
#include "tests/e2e/federation.h"
#include "tests/e2e/harness.h"

namespace estuary::testing {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;

// The whole answer to `request` sent to 127.0.0.1:port (the server closes).
std::string Http(uint16_t port, const std::string& request) {
  asio::io_context io;
  tcp::socket socket(io);
  boost::system::error_code ec;
  socket.connect({asio::ip::make_address("127.0.0.1"), port}, ec);
  if (ec) return "connect: " + ec.message();
  asio::write(socket, asio::buffer(request), ec);
  std::string answer;
  char buffer[4096];
  for (;;) {
    const size_t n = socket.read_some(asio::buffer(buffer), ec);
    answer.append(buffer, n);
    if (ec) break;
  }
  return answer;
}

std::string Get(uint16_t port, const std::string& path) {
  return Http(port, "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
}

// The samples of a scrape's body by their name and labels; every line must
// be a HELP, a TYPE, or a sample of a family that was TYPEd.
std::map<std::string, double> Samples(const std::string& answer) {
  std::map<std::string, double> samples;
  const size_t body = answer.find("\r\n\r\n");
  EXPECT_NE(body, std::string::npos) << answer;
  if (body == std::string::npos) return samples;
  EXPECT_EQ(answer.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << answer.substr(0, 200);
  EXPECT_NE(answer.find("Content-Type: text/plain; version=0.0.4"), std::string::npos);
  static const std::regex sample(R"(^([a-z_:][a-z0-9_:]*)(\{[a-z_]+="[^"]*"\})? (\S+)$)");
  static const std::regex type(R"(^# TYPE ([a-z_:][a-z0-9_:]*) (counter|gauge|histogram)$)");
  std::set<std::string> typed;
  std::istringstream lines(answer.substr(body + 4));
  std::string line;
  while (std::getline(lines, line)) {
    std::smatch m;
    if (line.rfind("# HELP ", 0) == 0) continue;
    if (std::regex_match(line, m, type)) {
      typed.insert(m[1]);
      continue;
    }
    if (!std::regex_match(line, m, sample)) {
      ADD_FAILURE() << "not a sample: " << line;
      continue;
    }
    const std::string family = std::regex_replace(m[1].str(), std::regex("_(bucket|sum|count)$"), "");
    EXPECT_TRUE(typed.count(m[1]) || typed.count(family)) << "no TYPE before " << line;
    samples[m[1].str() + m[2].str()] = m[3] == "+Inf" ? HUGE_VAL : std::stod(m[3]);
  }
  return samples;
}

TEST(Metrics, AFederationIsCountedWhereAPrometheusScraperLooks) {
  Federation f;
  f.exit_when_done = false;  // scraped after its last round, then stopped here
  f.Issue("site-a");
  f.Issue("site-b");
  const uint16_t port = f.StartServer(2, 2, {"--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(port, 0);
  auto announced = f.server().NextLine();
  ASSERT_TRUE(announced.ok()) << announced.status().ToString();
  std::smatch m;
  ASSERT_TRUE(std::regex_match(*announced, m, std::regex(R"(metrics on http://127\.0\.0\.1:(\d+)/metrics)")))
      << *announced;
  const uint16_t metrics = uint16_t(std::stoi(m[1]));

  auto before = Samples(Get(metrics, "/metrics"));
  EXPECT_EQ(before["estuary_rounds_total{state=\"committed\"}"], 0);
  EXPECT_EQ(before["estuary_connected_sites"], 0);
  EXPECT_EQ(before.count("estuary_dp_epsilon"), 0u) << "no DP, no epsilon";

  auto a = f.StartClient("site-a", port);
  auto b = f.StartClient("site-b", port);
  EXPECT_EQ(a->Wait(), 0);
  EXPECT_EQ(b->Wait(), 0);
  ASSERT_TRUE(f.AwaitCommitted(2));

  // A connection that is not TLS at all: one refused handshake.
  {
    const std::string refused = Http(port, "GET / HTTP/1.1\r\n\r\n");
    (void)refused;
  }
  std::map<std::string, double> after;
  for (int i = 0; i < 200; ++i) {  // the refusal is counted on the server's own time
    after = Samples(Get(metrics, "/metrics"));
    if (after["estuary_handshakes_refused_total"] >= 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_EQ(after["estuary_handshakes_refused_total"], 1);
  EXPECT_EQ(after["estuary_rounds_total{state=\"committed\"}"], 2);
  EXPECT_EQ(after["estuary_rounds_total{state=\"failed\"}"], 0);
  EXPECT_EQ(after["estuary_round_duration_seconds_count"], 2);
  EXPECT_EQ(after["estuary_round_duration_seconds_bucket{le=\"+Inf\"}"], 2);
  EXPECT_GT(after["estuary_round_duration_seconds_sum"], 0);
  EXPECT_LE(after["estuary_round_duration_seconds_bucket{le=\"0.1\"}"],
            after["estuary_round_duration_seconds_bucket{le=\"600\"}"]) << "buckets are cumulative";
  EXPECT_EQ(after["estuary_round"], 2);
  EXPECT_EQ(after["estuary_selected_sites"], 2);
  EXPECT_EQ(after["estuary_connected_sites"], 0) << "both sites left when the federation completed";
  // Two rounds, two sites, the MLP's 199,210 floats each way at least.
  constexpr double kModel = 199210.0 * 4;
  EXPECT_EQ(after["estuary_folds_total"], 4);
  EXPECT_EQ(after["estuary_folded_bytes_total"], 4 * kModel);
  EXPECT_GT(after["estuary_fold_seconds_total"], 0);
  EXPECT_GE(after["estuary_received_bytes_total"], 4 * kModel);
  EXPECT_GE(after["estuary_sent_bytes_total"], 4 * kModel);
  EXPECT_EQ(after["estuary_uploads_rejected_total{reason=\"checksum_mismatch\"}"], 0);

  // The round log agrees with what was counted.
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  double up = 0;
  for (const auto& r : *rounds) up += double(r.bytes_up);
  EXPECT_EQ(after["estuary_folded_bytes_total"], up);

  const std::string missing = Get(metrics, "/other");
  EXPECT_EQ(missing.rfind("HTTP/1.1 404 Not Found\r\n", 0), 0u) << missing;
  const std::string posted = Http(metrics, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
  EXPECT_EQ(posted.rfind("HTTP/1.1 405 Method Not Allowed\r\n", 0), 0u) << posted;

  kill(f.server().pid(), SIGTERM);
  EXPECT_EQ(f.WaitServer(), 0) << f.ServerLog();
}

// serve --tensorboard: one event file, a point per committed round, read by
// an independent reader (tests/proto/read_tfevents.py) and equal, as float32,
// to what the round log holds.
TEST(Metrics, TensorBoardPlotsEveryCommittedRoundAsTheRoundLogHasIt) {
  Federation f;
  f.Issue("site-a");
  f.Issue("site-b");
  const fs::path events_dir = f.dir() / "tensorboard";
  const uint16_t port = f.StartServer(2, 2, {"--tensorboard", events_dir.string()});
  auto a = f.StartClient("site-a", port);
  auto b = f.StartClient("site-b", port);
  EXPECT_EQ(a->Wait(), 0);
  EXPECT_EQ(b->Wait(), 0);
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(events_dir)) files.push_back(entry.path());
  ASSERT_EQ(files.size(), 1u);
  auto read = RunCommand(
      fmt::format("{} {}/proto/read_tfevents.py {}", ESTUARY_PYTHON, ESTUARY_TESTS_DIR, files[0].string()));
  ASSERT_EQ(read.exit_code, 0) << read.output;
  auto doc = nlohmann::json::parse(read.output, nullptr, false);
  ASSERT_FALSE(doc.is_discarded()) << read.output;
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(doc["events"].size(), rounds->size());
  ASSERT_EQ(rounds->size(), 2u);
  for (size_t i = 0; i < rounds->size(); ++i) {
    const server::RoundRecord& r = (*rounds)[i];
    const auto& event = doc["events"][i];
    EXPECT_EQ(event["step"], r.round);
    const auto& scalars = event["scalars"];
    EXPECT_EQ(scalars["round/train_loss"].get<double>(), double(float(r.train_loss)));
    EXPECT_EQ(scalars["round/updates_received"].get<double>(), 2.0);
    EXPECT_EQ(scalars["round/bytes_up"].get<double>(), double(float(r.bytes_up)));
    ASSERT_TRUE(r.test_accuracy.has_value());
    EXPECT_EQ(scalars["eval/accuracy"].get<double>(), double(float(*r.test_accuracy)));
    EXPECT_GT(scalars["round/seconds"].get<double>(), 0);
  }
}

// rounds watch follows a live federation from its round log and stops by
// itself once the server marks it complete: off a terminal, a line per round
// that ended (every one, however fast it went) and per change of the running one.
TEST(Metrics, RoundsWatchFollowsTheFederationAndStopsWhenItCompletes) {
  Federation f;
  f.Issue("site-a");
  f.Issue("site-b");
  const uint16_t port = f.StartServer(3, 2);
  const fs::path watched = f.dir() / "watch.log";
  ChildProcess watch({BinaryPath("estuary-server").string(), "rounds", "watch", "--db", f.db().string(), "--interval",
                      "0.02"},
                     watched);
  auto a = f.StartClient("site-a", port);
  auto b = f.StartClient("site-b", port);
  EXPECT_EQ(a->Wait(), 0);
  EXPECT_EQ(b->Wait(), 0);
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  ASSERT_EQ(watch.Wait(std::chrono::seconds(60)), 0) << "the watch did not stop when the federation completed";
  std::ifstream in(watched);
  const std::string log{std::istreambuf_iterator<char>(in), {}};
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok() && rounds->size() == 3u);
  for (const server::RoundRecord& r : *rounds) {
    const std::string committed =
        fmt::format("round {} of 3 committed: 2 of 2 updates, test accuracy {:.4f}\n", r.round, *r.test_accuracy);
    EXPECT_NE(log.find(committed), std::string::npos) << committed << "\n" << log;
  }
  EXPECT_NE(log.find("federation complete: 3 rounds committed, 0 failed\n"), std::string::npos) << log;
  // Once, on the finished log: the last round and the whole federation's figures.
  auto once = RunCommand(fmt::format("{} rounds watch --once --db {}", BinaryPath("estuary-server").string(),
                                     f.db().string()));
  EXPECT_EQ(once.exit_code, 0) << once.output;
  EXPECT_NE(once.output.find("round 3 of 3 committed: 2 of 2 updates"), std::string::npos) << once.output;
}

TEST(Metrics, AnAddressThatIsNotOneIsRefusedInOneLine) {
  Federation f;
  const std::string server_bin = BinaryPath("estuary-server").string();
  std::vector<std::string> args = f.ServeArgs(1, 1, {"--metrics-listen", "localhost:0"});
  std::string command = server_bin;
  for (const std::string& arg : args) command += " '" + arg + "'";
  auto run = RunCommand(command);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("--metrics-listen 'localhost:0': localhost is not an IP address"), std::string::npos)
      << run.output;
}

}  // namespace
}  // namespace estuary::testing
