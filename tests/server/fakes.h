// Fakes for the server's round logic without sockets or waiting: a session
// that records what it is sent, a clock the test advances, the two executors
// run by the test on its own thread, and a Coordinator over a real Store in a
// temporary directory that uses all three.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/asio.h"
#include "server/client_session.h"
#include "server/clock.h"
#include "server/config.h"
#include "server/async_coordinator.h"
#include "server/coordinator.h"
#include "server/store.h"
#include "tests/e2e/harness.h"

namespace estuary::server::fake {

// A connection that remembers everything the server did with it.
class FakeSession final : public ClientSession {
 public:
  struct ModelSend {
    uint64_t round = 0;
    std::shared_ptr<const std::vector<float>> model;
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    std::shared_ptr<const std::vector<float>> tail;
  };

  explicit FakeSession(std::string name, std::string serial = "01")
      : name_(std::move(name)), serial_(std::move(serial)), address_("127.0.0.1:" + name_) {}

  const std::string& name() const override { return name_; }
  const std::string& peer_serial() const override { return serial_; }
  const std::string& address() const override { return address_; }
  void Send(const v1::Envelope& envelope) override {
    if (!closed_ && !closing_) sent.push_back(envelope);
  }
  void SendModel(uint64_t round, std::shared_ptr<const std::vector<float>> model, std::function<void()> on_sent,
                 std::vector<std::pair<uint64_t, uint64_t>> ranges,
                 std::shared_ptr<const std::vector<float>> tail) override {
    models.push_back({round, std::move(model), std::move(ranges), std::move(tail)});
    on_model_sent_ = std::move(on_sent);
  }
  void SendErrorAndClose(v1::Error::Code code, const std::string& message) override {
    if (closed_ || closing_) return;
    error = code;
    error_message = message;
    closing_ = true;
  }
  void CloseAfterWrites() override { closing_ = true; }
  void Pause() override { paused = true; }
  void Resume() override {
    paused = false;
    ++resumed;
  }
  bool closed() const override { return closed_; }

  // The last chunk of the model being streamed is written.
  void FinishDownload() {
    if (auto on_sent = std::move(on_model_sent_)) on_sent();
  }
  bool downloading() const { return bool(on_model_sent_); }
  // The connection ends: the peer went away, or what was queued before a
  // close asked for is written.
  void Close() {
    if (closed_) return;
    closed_ = true;
    FinishDownload();
    if (on_closed) on_closed(*this);
  }
  bool closing() const { return closing_; }

  // The envelopes of one kind sent so far.
  std::vector<v1::Envelope> SentOf(v1::Envelope::BodyCase body) const {
    std::vector<v1::Envelope> of;
    for (const auto& e : sent) {
      if (e.body_case() == body) of.push_back(e);
    }
    return of;
  }

  // Told when the session closes, as a Session tells its listener.
  std::function<void(ClientSession&)> on_closed;
  std::vector<v1::Envelope> sent;
  std::vector<ModelSend> models;
  std::optional<v1::Error::Code> error;
  std::string error_message;
  bool paused = false;
  int resumed = 0;

 private:
  std::string name_, serial_, address_;
  std::function<void()> on_model_sent_;
  bool closing_ = false;
  bool closed_ = false;
};

// Time that moves only when the test says so.
class FakeClock final : public Clock {
 public:
  std::chrono::steady_clock::time_point Now() const override { return now_; }
  int64_t UnixMs() const override {
    return 1'700'000'000'000 + std::chrono::duration_cast<std::chrono::milliseconds>(now_.time_since_epoch()).count();
  }
  std::unique_ptr<Timer> MakeTimer() override;

  // Moves time forward, firing every timer that comes due on the way, in
  // the order they come due.
  void Advance(std::chrono::steady_clock::duration by);
  // Timers armed and not yet fired or cancelled.
  size_t armed() const { return due_.size(); }

 private:
  class FakeTimer;
  std::chrono::steady_clock::time_point now_{};
  std::map<FakeTimer*, std::chrono::steady_clock::time_point> due_;
};

// The I/O thread and the worker of a Coordinator, both run by the test:
// nothing posted runs until RunUntilIdle.
struct Executors {
  boost::asio::io_context io;
  boost::asio::io_context worker;
  // Runs both until neither has anything left; returns the handlers run.
  size_t RunUntilIdle();
};

// A federation of the "mlp" model (fedavg): three rounds of two clients,
// which start once two are connected and aggregate from one update, with a
// deadline of 60 s; its store and checkpoints in a temporary directory. A
// test changes `config` before Start().
struct CoordinatorRig {
  CoordinatorRig();
  // Finalizes `config`, opens the store and recovers a Coordinator of it.
  Status Start();
  // A client of that name says hello, holding no model (and keeping the
  // models it trains from, if `keeps_model`; answering evaluation rounds, if
  // `evaluates`).
  std::shared_ptr<FakeSession> Connect(const std::string& name, const std::string& serial = "01",
                                       bool keeps_model = false, bool evaluates = false);
  // Every selected session's download is written, as often as it takes.
  void FinishDownloads(const std::vector<std::shared_ptr<FakeSession>>& sessions);

  // An update of `delta` for `round`, as a site sends it: UpdateBegin, the
  // payload in chunks of 64 KiB, UpdateCommit with its SHA-256.
  void Upload(const std::shared_ptr<FakeSession>& session, uint64_t round, const std::vector<float>& delta,
              uint64_t examples = 10, double loss = 1.0);
  void Begin(const std::shared_ptr<FakeSession>& session, uint64_t round, uint64_t examples = 10, double loss = 1.0);
  // The first `chunks` chunks of `delta` (all by default).
  void SendChunks(const std::shared_ptr<FakeSession>& session, uint64_t round, const std::vector<float>& delta,
                  std::optional<size_t> chunks = std::nullopt);
  void Commit(const std::shared_ptr<FakeSession>& session, uint64_t round, const std::vector<float>& delta);

  // The global model before round 1.
  const std::vector<float>& initial() const { return *initial_; }
  const Manifest& manifest() const { return manifest_; }

  ::estuary::testing::TempDir dir;
  Executors executors;
  FakeClock clock;
  ServerConfig config;
  std::unique_ptr<Store> store;
  std::unique_ptr<Coordinator> coordinator;
  // Under config.mode = "async", Start() makes this one instead, and the
  // helpers above talk to it; uploads then say they trained from
  // `trained_from` (unset: they say nothing).
  std::unique_ptr<AsyncCoordinator> async;
  std::optional<uint64_t> trained_from;
  RoundDriver& driver() { return async ? static_cast<RoundDriver&>(*async) : *coordinator; }

 private:
  std::shared_ptr<const std::vector<float>> initial_;
  Manifest manifest_;
};

}  // namespace estuary::server::fake
