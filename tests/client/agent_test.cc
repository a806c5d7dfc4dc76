// Agent against servers that misbehave: real sockets, real TLS, the real
// Agent, a fake trainer. Every stage of a connection has a deadline
// (connect, TLS handshake, read, write): a server that accepts and then
// stalls there costs the agent one line naming the stage and the server,
// within that deadline, and a reconnect. A server whose certificate is not
// the federation's server's for the host dialled is refused for good, before
// anything is sent to it. And a digest announced in upper case is the same
// digest.
#include "client/agent.h"

#include <gtest/gtest.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio/read.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/write.hpp>
#include <cctype>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "crypto/certs.h"
#include "crypto/sha256.h"
#include "crypto/transfer_digest.h"
#include "crypto/tls.h"
#include "proto/frame.h"
#include "proto/wire.h"
#include "tests/crypto/test_dir.h"

namespace estuary::client {
namespace {

namespace asio = boost::asio;
namespace ssl = boost::asio::ssl;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using boost::system::error_code;
using crypto::testing::TempDir;

// Every line the agent logs, as it logs it.
class LogLines : public spdlog::sinks::base_sink<std::mutex> {
 public:
  std::vector<std::string> Lines() {
    std::lock_guard<std::mutex> lock(mutex_);
    return lines_;
  }
  // The first line holding `text`, or "".
  std::string Find(const std::string& text) {
    for (const std::string& line : Lines()) {
      if (line.find(text) != std::string::npos) return line;
    }
    return "";
  }
  int Count(const std::string& text) {
    int n = 0;
    for (const std::string& line : Lines()) n += line.find(text) != std::string::npos;
    return n;
  }
  std::string All() {
    std::string all;
    for (const std::string& line : Lines()) all += line + "\n";
    return all;
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    lines_.emplace_back(msg.payload.data(), msg.payload.size());
  }
  void flush_() override {}

 private:
  std::vector<std::string> lines_;
};

// A trainer that trains nothing: its update is `elements` values of 0.25.
class FakeTrainer : public Trainer {
 public:
  uint64_t num_examples() const override { return 10; }
  Result<Update> Train(std::span<const float> global, const Manifest& manifest, const v1::TaskConfig&, uint64_t,
                       std::string_view) override {
    ++calls;
    Update update;
    update.num_examples = 10;
    update.train_loss = 1;
    update.manifest = manifest;
    update.payload.assign(global.size(), 0.25f);
    return update;
  }
  // SCAFFOLD: the same update, in one optimizer step.
  Result<Update> TrainControlled(std::span<const float> global, const Manifest& manifest, const v1::TaskConfig& task,
                                 uint64_t round, std::string_view name, std::span<const float>,
                                 std::span<const float>) override {
    auto update = Train(global, manifest, task, round, name);
    if (update.ok()) update->local_steps = 1;
    return update;
  }
  std::atomic<int> calls{0};
};

// One accepted connection of a fake server, TLS or not.
struct Peer {
  explicit Peer(tcp::socket s) : socket(std::move(s)) {}
  tcp::socket socket;
  std::unique_ptr<ssl::stream<tcp::socket&>> tls;
  std::array<uint8_t, 4> header{};
  std::vector<uint8_t> body;
  std::vector<v1::Envelope> received;
  bool handshake_ok = false;
  std::string handshake_failure;
  std::deque<std::shared_ptr<proto::Frame>> outbox;  // one write at a time on a TLS stream
};

// A fake server on 127.0.0.1: counts and keeps the connections it accepts
// and hands each to `on_accept`.
class FakeServer {
 public:
  explicit FakeServer(asio::io_context& io, int backlog = asio::socket_base::max_listen_connections)
      : acceptor_(io) {
    acceptor_.open(tcp::v4());
    acceptor_.set_option(tcp::acceptor::reuse_address(true));
    acceptor_.bind({asio::ip::make_address("127.0.0.1"), 0});
    acceptor_.listen(backlog);
  }
  // Closes every connection: their pending handlers end with an error and
  // touch nothing of the test that is gone.
  ~FakeServer() {
    error_code ignored;
    acceptor_.close(ignored);
    for (const auto& peer : peers) peer->socket.close(ignored);
  }
  uint16_t port() const { return acceptor_.local_endpoint().port(); }
  void Accept(std::function<void(std::shared_ptr<Peer>)> on_accept) {
    on_accept_ = std::move(on_accept);
    Next();
  }
  int accepts() const { return int(peers.size()); }
  std::vector<std::shared_ptr<Peer>> peers;
  std::vector<Clock::time_point> accepted_at;

 private:
  void Next() {
    acceptor_.async_accept([this](const error_code& ec, tcp::socket socket) {
      if (ec) return;
      auto peer = std::make_shared<Peer>(std::move(socket));
      peers.push_back(peer);
      accepted_at.push_back(Clock::now());
      if (on_accept_) on_accept_(peer);
      Next();
    });
  }
  tcp::acceptor acceptor_;
  std::function<void(std::shared_ptr<Peer>)> on_accept_;
};

void WriteNext(const std::shared_ptr<Peer>& peer) {
  auto frame = peer->outbox.front();
  asio::async_write(*peer->tls, asio::buffer(frame->data(), frame->size()), [peer, frame](const error_code& ec, size_t) {
    peer->outbox.pop_front();
    if (!ec && !peer->outbox.empty()) WriteNext(peer);
  });
}

void Write(const std::shared_ptr<Peer>& peer, proto::Frame frame) {
  peer->outbox.push_back(std::make_shared<proto::Frame>(std::move(frame)));
  if (peer->outbox.size() == 1) WriteNext(peer);
}

void Write(const std::shared_ptr<Peer>& peer, const v1::Envelope& envelope) { Write(peer, proto::EncodeFrame(envelope)); }

// Reads frames into peer->received, calling `on_frame` for each, for as long
// as it returns true.
void ReadFrames(const std::shared_ptr<Peer>& peer, std::function<bool(const v1::Envelope&)> on_frame) {
  asio::async_read(*peer->tls, asio::buffer(peer->header), [peer, on_frame](const error_code& ec, size_t) {
    if (ec) return;
    auto size = proto::ParseFrameHeader(peer->header, 1u << 30);
    if (!size.ok()) return;
    peer->body.resize(*size);
    asio::async_read(*peer->tls, asio::buffer(peer->body), [peer, on_frame](const error_code& ec, size_t) {
      if (ec) return;
      auto envelope = proto::ParseEnvelope(peer->body.data(), peer->body.size());
      if (!envelope.ok()) return;
      peer->received.push_back(*envelope);
      if (on_frame(peer->received.back())) ReadFrames(peer, on_frame);
    });
  });
}

// Completes the server's side of the TLS handshake, then `then`.
void Handshake(const std::shared_ptr<Peer>& peer, ssl::context& context, std::function<void()> then) {
  peer->tls = std::make_unique<ssl::stream<tcp::socket&>>(peer->socket, context);
  peer->tls->async_handshake(ssl::stream_base::server, [peer, then](const error_code& ec) {
    if (ec) {
      peer->handshake_failure = ec.message();
      return;
    }
    peer->handshake_ok = true;
    then();
  });
}

class AgentDeadlines : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    certs_ = new TempDir;
    const auto& d = certs_->path();
    ASSERT_TRUE(crypto::InitCa(d).ok());
    ASSERT_TRUE(crypto::IssueCertificate(d, "server", {.role = crypto::CertRole::kServer}).ok());
    ASSERT_TRUE(crypto::IssueCertificate(d, "elsewhere", {.role = crypto::CertRole::kServer,
                                                           .dns = {"fl.example.org"}}).ok());
    ASSERT_TRUE(crypto::IssueCertificate(d, "server-expired", {.not_before = -std::chrono::hours(48),
                                                               .not_after = -std::chrono::hours(24),
                                                               .role = crypto::CertRole::kServer})
                    .ok());
    for (const char* site : {"site-a", "site-b"}) ASSERT_TRUE(crypto::IssueCertificate(d, site).ok());
  }
  static void TearDownTestSuite() {
    delete certs_;
    certs_ = nullptr;
  }
  static crypto::TlsFiles Files(const std::string& name) {
    const auto& d = certs_->path();
    return {d / (name + ".pem"), d / (name + ".key"), d / "ca.pem"};
  }
  // A server context as our server makes it.
  static std::shared_ptr<ssl::context> ServerContext() {
    auto ctx = crypto::MakeServerContext(Files("server"));
    EXPECT_TRUE(ctx.ok()) << ctx.status().ToString();
    return ctx.ok() ? *ctx : nullptr;
  }
  // A server context that does not run our checks, holding `name`'s
  // certificate and asking nothing of the client: a rogue server.
  static std::shared_ptr<ssl::context> RogueContext(const std::string& name) {
    auto ctx = std::make_shared<ssl::context>(ssl::context::tls_server);
    ctx->use_certificate_chain_file(Files(name).cert.string());
    ctx->use_private_key_file(Files(name).key.string(), ssl::context::pem);
    ctx->set_verify_mode(ssl::verify_none);
    return ctx;
  }

  void SetUp() override {
    sink_ = std::make_shared<LogLines>();
    spdlog::default_logger()->sinks().push_back(sink_);
    level_ = spdlog::get_level();
    spdlog::set_level(spdlog::level::info);
  }
  void TearDown() override {
    if (agent_) agent_->Stop();
    io_.restart();
    io_.poll();
    training_.join();
    auto& sinks = spdlog::default_logger()->sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
    spdlog::set_level(level_);
  }

  // Short deadlines, fast reconnects.
  AgentOptions Options(uint16_t port, const std::string& host = "127.0.0.1") {
    AgentOptions options;
    options.host = host;
    options.port = port;
    auto tls = crypto::MakeClientContext(Files("site-a"));
    EXPECT_TRUE(tls.ok()) << tls.status().ToString();
    options.tls = tls.ok() ? *tls : nullptr;
    options.label = "site-a";
    options.initial_backoff_s = 0.05;
    options.max_backoff_s = 0.1;
    options.connect_timeout_s = options.handshake_timeout_s = options.read_timeout_s = options.write_timeout_s = 0.5;
    return options;
  }
  void Start(const AgentOptions& options) {
    agent_ = std::make_shared<Agent>(io_, options, trainer_, training_.get_executor());
    agent_->on_finished = [this](const Status& status) { finished_ = status; };
    started_ = Clock::now();
    agent_->Start();
  }
  // Runs the io_context until `done` or `limit`; whether `done`.
  bool RunUntil(const std::function<bool()>& done, std::chrono::milliseconds limit = std::chrono::seconds(20)) {
    const auto deadline = Clock::now() + limit;
    while (!done() && Clock::now() < deadline) io_.run_one_for(std::chrono::milliseconds(10));
    return done();
  }
  static double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

  static TempDir* certs_;
  asio::io_context io_;
  asio::thread_pool training_{1};
  FakeTrainer trainer_;
  std::shared_ptr<Agent> agent_;
  std::optional<Status> finished_;
  Clock::time_point started_;
  std::shared_ptr<LogLines> sink_;
  spdlog::level::level_enum level_ = spdlog::level::info;
};

TempDir* AgentDeadlines::certs_ = nullptr;

// A server that accepts the connection and never says a word: the TLS
// handshake has its deadline, and the agent tries again.
TEST_F(AgentDeadlines, AServerThatNeverCompletesTheHandshake) {
  FakeServer server(io_);
  server.Accept([](std::shared_ptr<Peer>) {});  // kept open, never read
  Start(Options(server.port()));
  ASSERT_TRUE(RunUntil([&] { return server.accepts() >= 3; })) << sink_->All();
  const std::string line = fmt::format("TLS handshake with 127.0.0.1:{}: timed out after 0.5 s", server.port());
  EXPECT_GE(sink_->Count(line), 2) << sink_->All();
  // Each attempt ends at its deadline, and the next follows after the backoff.
  for (int i = 1; i < 3; ++i) {
    const double gap = Seconds(server.accepted_at[i] - server.accepted_at[i - 1]);
    EXPECT_GE(gap, 0.45) << i;
    EXPECT_LT(gap, 0.5 + 0.1 + 1.0) << i;
  }
  EXPECT_FALSE(finished_) << "a stalled server is retried";
}

// A server that completes the handshake and never answers the Hello.
TEST_F(AgentDeadlines, AServerThatNeverAnswers) {
  auto context = ServerContext();
  FakeServer server(io_);
  std::vector<Clock::time_point> hellos;
  server.Accept([&](std::shared_ptr<Peer> peer) {
    Handshake(peer, *context, [&, peer] {
      ReadFrames(peer, [&](const v1::Envelope& e) {
        if (e.has_hello()) hellos.push_back(Clock::now());
        return true;
      });
    });
  });
  Start(Options(server.port()));
  ASSERT_TRUE(RunUntil([&] { return hellos.size() >= 2; })) << sink_->All();
  const std::string line = fmt::format("read from 127.0.0.1:{}: nothing from the server for 0.5 s", server.port());
  EXPECT_GE(sink_->Count(line), 1) << sink_->All();
  const double gap = Seconds(hellos[1] - hellos[0]);
  EXPECT_GE(gap, 0.45);
  EXPECT_LT(gap, 0.5 + 0.1 + 1.0);
  EXPECT_FALSE(finished_);
}

// A server that goes quiet after its Welcome: the agent allows three of the
// heartbeat intervals the server asked for (it echoes ours), not fewer.
TEST_F(AgentDeadlines, ASilentServerIsAllowedThreeHeartbeats) {
  auto context = ServerContext();
  FakeServer server(io_);
  server.Accept([&](std::shared_ptr<Peer> peer) {
    Handshake(peer, *context, [&, peer] {
      ReadFrames(peer, [peer](const v1::Envelope& e) {
        if (e.has_hello()) {
          v1::Envelope welcome;
          welcome.mutable_welcome()->set_client_name("site-a");
          welcome.mutable_welcome()->set_heartbeat_ms(400);
          Write(peer, welcome);
        }
        return true;  // heartbeats read, never echoed
      });
    });
  });
  Start(Options(server.port()));
  ASSERT_TRUE(RunUntil([&] { return server.accepts() >= 2; })) << sink_->All();
  const double gap = Seconds(server.accepted_at[1] - server.accepted_at[0]);
  EXPECT_GE(gap, 1.15) << "3 x 400 ms, more than the read deadline's 0.5 s";
  EXPECT_LT(gap, 1.2 + 0.1 + 1.0);
  EXPECT_NE(sink_->Find(fmt::format("read from 127.0.0.1:{}: nothing from the server for 1.", server.port())), "")
      << sink_->All();
}

// A listener whose accept queue is full: the SYN goes unanswered and the
// connect itself has to time out.
TEST_F(AgentDeadlines, AConnectThatHangs) {
  FakeServer server(io_, 0);  // backlog 0: one connection fills the queue
  // Fill it with connections nobody accepts (non-blocking: the last ones hang).
  std::vector<int> fillers;
  for (int i = 0; i < 3; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(server.port());
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    (void)connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to);
    fillers.push_back(fd);
  }
  // The last filler must still be waiting, or this kernel answers anyway.
  pollfd last{fillers.back(), POLLOUT, 0};
  const bool hangs = poll(&last, 1, 300) == 0;
  if (!hangs) {
    for (int fd : fillers) close(fd);
    GTEST_SKIP() << "this kernel completes connections beyond a full accept queue";
  }
  Start(Options(server.port()));
  const std::string line = fmt::format("connect to 127.0.0.1:{}: timed out after 0.5 s", server.port());
  ASSERT_TRUE(RunUntil([&] { return sink_->Count(line) >= 2; }, std::chrono::seconds(10))) << sink_->All();
  EXPECT_FALSE(finished_);
  for (int fd : fillers) close(fd);
}

// A round's model, announced by `announce(digest(model))` and sent in chunks.
struct RoundPlan {
  uint64_t elements = 0;
  std::function<std::string(const std::string&)> announce = [](const std::string& c) { return c; };
  bool read_after_model = true;  // false: the server stops reading once the model is sent
  // SCAFFOLD: c, sent after the model (past its end) and announced by
  // `announce_control(digest(c))`, in a task of learning rate 0.5; empty: none.
  std::vector<float> control;
  std::function<std::string(const std::string&)> announce_control = [](const std::string& c) { return c; };
};

// A server that welcomes the site and starts round 1 with a model of
// plan.elements zeros, reading what the site sends (or not).
void ServeRound(FakeServer& server, ssl::context& context, RoundPlan plan) {
  server.Accept([&context, plan](std::shared_ptr<Peer> peer) {
    Handshake(peer, context, [peer, plan] {
      ReadFrames(peer, [peer, plan](const v1::Envelope& e) {
        if (!e.has_hello()) return true;
        v1::Envelope welcome;
        welcome.mutable_welcome()->set_client_name("site-a");
        welcome.mutable_welcome()->set_chunk_bytes(1 << 20);
        welcome.mutable_welcome()->set_heartbeat_ms(60000);
        Write(peer, welcome);
        auto model = std::make_shared<std::vector<float>>(plan.elements, 0.0f);
        Manifest manifest;
        manifest.Append("w", {int64_t(plan.elements)});
        v1::Envelope start;
        auto* round = start.mutable_round_start();
        round->set_round(1);
        round->set_model_version(0);
        round->set_model_checksum(crypto::Sha256Hex(model->data(), model->size() * sizeof(float)));
        round->set_model_digest(plan.announce(crypto::TransferDigestHex(model->data(), model->size() * sizeof(float))));
        *round->mutable_manifest() = proto::ToProto(manifest);
        round->set_deadline_unix_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
        round->set_model_follows(true);
        const uint64_t bytes = model->size() * sizeof(float);
        if (!plan.control.empty()) {
          round->set_control_follows(true);
          round->set_control_digest(plan.announce_control(crypto::TransferDigestHex(plan.control.data(), bytes)));
          round->mutable_task()->set_learning_rate(0.5f);
        }
        Write(peer, start);
        for (uint64_t at = 0; at < bytes; at += 1 << 20) {
          Write(peer, proto::EncodeModelChunk(1, at, reinterpret_cast<const char*>(model->data()) + at,
                                              std::min<uint64_t>(1 << 20, bytes - at)));
        }
        for (uint64_t at = 0; at < bytes && !plan.control.empty(); at += 1 << 20) {
          Write(peer, proto::EncodeModelChunk(1, bytes + at, reinterpret_cast<const char*>(plan.control.data()) + at,
                                              std::min<uint64_t>(1 << 20, bytes - at)));
        }
        return plan.read_after_model;
      });
    });
  });
}

// A server that stops reading while the site uploads: the write that cannot
// finish has its deadline.
TEST_F(AgentDeadlines, AServerThatStopsReadingMidUpload) {
  auto context = ServerContext();
  FakeServer server(io_);
  // 32 MiB up: far more than both ends' socket buffers hold.
  ServeRound(server, *context, {.elements = 8u << 20, .read_after_model = false});
  AgentOptions options = Options(server.port());
  options.read_timeout_s = 30;  // the write's deadline, not the read's, ends this connection
  Start(options);
  const std::string line = fmt::format("write to 127.0.0.1:{}: a frame of", server.port());
  ASSERT_TRUE(RunUntil([&] { return sink_->Count(line) >= 1 && server.accepts() >= 2; })) << sink_->All();
  EXPECT_NE(sink_->Find(line).find("not taken in 0.5 s"), std::string::npos) << sink_->All();
  EXPECT_GE(trainer_.calls.load(), 1);
  EXPECT_FALSE(finished_);
}

// The model's digest announced in upper case: the same bytes, so the site
// trains and uploads (it used to drop the connection as a mismatch).
TEST_F(AgentDeadlines, AnUpperCaseDigestIsTheSameDigest) {
  auto context = ServerContext();
  FakeServer server(io_);
  ServeRound(server, *context, {.elements = 1000, .announce = [](const std::string& digest) {
                                  std::string upper = digest;
                                  for (char& c : upper) c = char(std::toupper(static_cast<unsigned char>(c)));
                                  return upper;
                                }});
  Start(Options(server.port()));
  auto commits = [&] {
    for (const auto& peer : server.peers) {
      for (const auto& e : peer->received) {
        if (e.has_update_commit()) return true;
      }
    }
    return false;
  };
  ASSERT_TRUE(RunUntil(commits)) << sink_->All();
  EXPECT_EQ(server.accepts(), 1) << sink_->All();
  EXPECT_EQ(sink_->Count("disconnected"), 0) << sink_->All();
  EXPECT_EQ(trainer_.calls.load(), 1);
}

// A model whose bytes do not match the announced digest is never trained on:
// the site names the mismatch and drops the connection.
TEST_F(AgentDeadlines, AModelThatDoesNotMatchItsDigestIsNotTrainedOn) {
  auto context = ServerContext();
  FakeServer server(io_);
  ServeRound(server, *context, {.elements = 1000, .announce = [](const std::string& digest) {
                                  std::string other = digest;
                                  other[0] = other[0] == '0' ? '1' : '0';
                                  return other;
                                }});
  Start(Options(server.port()));
  ASSERT_TRUE(RunUntil([&] { return sink_->Count("model digest") >= 1; })) << sink_->All();
  EXPECT_NE(sink_->Find("model digest").find("!= announced"), std::string::npos) << sink_->All();
  EXPECT_EQ(trainer_.calls.load(), 0);
  agent_->Stop();
}

// SCAFFOLD: c follows the model past its end, checked against its own
// digest; the site trains through its SiteControl and uploads Δc_i after
// its delta (Δc_i = −c − Δy / (K η), here −c − 0.25 / 0.5), one digest over
// both, and keeps c_i⁺ = Δc_i. A c that does not match its digest is never
// trained on; a site with no control variate refuses the round in one line.
TEST_F(AgentDeadlines, ControlVariatesFollowTheModelAndGoBackAfterTheDelta) {
  constexpr uint64_t kElements = 300'000;  // c crosses a chunk boundary
  std::vector<float> control(kElements);
  for (uint64_t i = 0; i < kElements; ++i) control[i] = float(i % 5) - 2.0f;
  auto context = ServerContext();
  {
    FakeServer server(io_);
    ServeRound(server, *context, {.elements = kElements, .control = control, .announce_control = [](const std::string&) {
                                    return std::string(32, 'a');
                                  }});
    AgentOptions options = Options(server.port());
    options.scaffold = std::make_shared<SiteControl>();
    Start(options);
    ASSERT_TRUE(RunUntil([&] { return sink_->Count("control variate digest") >= 1; })) << sink_->All();
    EXPECT_EQ(trainer_.calls.load(), 0);
    agent_->Stop();
  }
  {
    FakeServer server(io_);
    ServeRound(server, *context, {.elements = kElements, .control = control});
    AgentOptions options = Options(server.port());
    auto site_control = std::make_shared<SiteControl>();
    options.scaffold = site_control;
    Start(options);
    auto committed = [&]() -> const v1::Envelope* {
      for (const auto& peer : server.peers) {
        for (const auto& e : peer->received) {
          if (e.has_update_commit()) return &e;
        }
      }
      return nullptr;
    };
    ASSERT_TRUE(RunUntil([&] { return committed() != nullptr; })) << sink_->All();
    std::vector<float> expected(kElements, 0.25f);
    std::vector<float> control_delta(kElements);
    for (uint64_t i = 0; i < kElements; ++i) control_delta[i] = float(-double(control[i]) - 0.25 / 0.5);
    expected.insert(expected.end(), control_delta.begin(), control_delta.end());
    std::vector<float> uploaded;
    bool announced = false;
    for (const auto& e : server.peers.back()->received) {
      if (e.has_update_begin()) announced = e.update_begin().control_follows();
      if (!e.has_update_chunk()) continue;
      EXPECT_EQ(e.update_chunk().offset(), uploaded.size() * sizeof(float));
      const std::string& data = e.update_chunk().data();
      const size_t at = uploaded.size();
      uploaded.resize(at + data.size() / sizeof(float));
      std::memcpy(uploaded.data() + at, data.data(), data.size());
    }
    EXPECT_TRUE(announced);
    EXPECT_EQ(uploaded, expected);
    EXPECT_EQ(committed()->update_commit().digest(),
              crypto::TransferDigestHex(expected.data(), expected.size() * sizeof(float)));
    EXPECT_EQ(std::vector<float>(site_control->value().begin(), site_control->value().end()), control_delta);
    agent_->Stop();
  }
  {
    FakeServer server(io_);
    ServeRound(server, *context, {.elements = 1000, .control = std::vector<float>(1000, 1.0f)});
    Start(Options(server.port()));  // no SiteControl
    auto refusal = [&]() -> std::string {
      for (const auto& peer : server.peers) {
        for (const auto& e : peer->received) {
          if (e.has_refusal()) return e.refusal().reason();
        }
      }
      return "";
    };
    ASSERT_TRUE(RunUntil([&] { return !refusal().empty(); })) << sink_->All();
    EXPECT_EQ(refusal(), "site-a: round 1 sends SCAFFOLD's control variate, but this site keeps no control variate of "
                         "its own (c_i)");
    EXPECT_EQ(trainer_.calls.load(), 1) << "the round before; not this one";
  }
}

// Servers that are not the federation's server at the address dialled: the
// site refuses them for good at the handshake and sends them nothing.
TEST_F(AgentDeadlines, ARogueServerIsRefusedForGood) {
  struct Rogue {
    std::string cert;
    std::string reason;
  };
  for (const Rogue& rogue : {Rogue{"site-b", "unsuitable certificate purpose"},
                             Rogue{"elsewhere", "IP address mismatch"}}) {
    SCOPED_TRACE(rogue.cert);
    auto context = RogueContext(rogue.cert);
    FakeServer server(io_);
    server.Accept([&](std::shared_ptr<Peer> peer) {
      Handshake(peer, *context, [peer] { ReadFrames(peer, [](const v1::Envelope&) { return true; }); });
    });
    finished_.reset();
    Start(Options(server.port()));
    ASSERT_TRUE(RunUntil([&] { return finished_.has_value(); })) << sink_->All();
    EXPECT_EQ(finished_->code(), Code::kFailedPrecondition);
    EXPECT_EQ(finished_->message(),
              fmt::format("site-a: refused the server at 127.0.0.1:{}: its certificate failed verification ({}): it is "
                          "not the federation's server for that address; nothing was sent to it",
                          server.port(), rogue.reason));
    io_.run_for(std::chrono::milliseconds(300));
    EXPECT_EQ(server.accepts(), 1) << "not retried";
    for (const auto& peer : server.peers) EXPECT_TRUE(peer->received.empty()) << "sent nothing";
    EXPECT_EQ(trainer_.calls.load(), 0);
    agent_.reset();
  }
}

// An expired server certificate is a matter of time, not of identity: the
// operator renews it, so the site keeps trying.
TEST_F(AgentDeadlines, AnExpiredServerCertificateIsRetried) {
  auto context = RogueContext("server-expired");
  FakeServer server(io_);
  server.Accept([&](std::shared_ptr<Peer> peer) { Handshake(peer, *context, [] {}); });
  Start(Options(server.port()));
  ASSERT_TRUE(RunUntil([&] { return server.accepts() >= 2; })) << sink_->All();
  EXPECT_FALSE(finished_);
  EXPECT_NE(sink_->Find("certificate has expired"), "") << sink_->All();
}

}  // namespace
}  // namespace estuary::client
