// Federation: an end-to-end test's federation — a CA and certificates, a
// synthetic MNIST-shaped data set, the real estuary-server and estuary-client
// binaries as child processes, and the round log they leave.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "crypto/certs.h"
#include "server/store.h"
#include "simulations/server_process.h"
#include "tests/e2e/harness.h"

namespace estuary::testing {

class Federation {
 public:
  Federation() {
    EXPECT_TRUE(crypto::InitCa(certs_).ok());
    Issue("server", {.role = crypto::CertRole::kServer});
    WriteSyntheticMnist(data_, 300, 200, 7);
  }
  // The logs go with the temporary directory: a failed test shows their
  // tails first, for failures seen once under load.
  ~Federation() {
    if (::testing::Test::HasFailure()) PrintLogTails(dir_.path(), 40);
  }
  Federation(const Federation&) = delete;
  Federation& operator=(const Federation&) = delete;

  // Whether the server stops after the last round (--exit-when-done); a test
  // that inspects the server afterwards stops it itself.
  bool exit_when_done = true;
  // Whether the server scores the synthetic data (--eval-data); a model it
  // knows only as a file (--initial-model) has no evaluator.
  bool eval_data = true;

  void Issue(const std::string& name, const crypto::CertOptions& options = {}) {
    Status s = crypto::IssueCertificate(certs_, name, options);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  crypto::TlsFiles Files(const std::string& name) const {
    return {certs_ / (name + ".pem"), certs_ / (name + ".key"), certs_ / "ca.pem"};
  }

  // Starts estuary-server on an ephemeral port; returns the port.
  uint16_t StartServer(uint64_t rounds, uint32_t clients, const std::vector<std::string>& extra = {},
                       const std::string& listen = "127.0.0.1:0") {
    server_ = std::make_unique<simulations::ServerProcess>();
    EXPECT_TRUE(server_->Spawn(BinaryPath("estuary-server"), ServeArgs(rounds, clients, extra, listen),
                               dir_ / "server.log")
                    .ok());
    auto port = server_->WaitForPort();
    EXPECT_TRUE(port.ok()) << port.status().ToString() << "\n" << ServerLog();
    return port.ok() ? *port : 0;
  }
  // `estuary-server serve`'s arguments for this federation.
  std::vector<std::string> ServeArgs(uint64_t rounds, uint32_t clients, const std::vector<std::string>& extra = {},
                                     const std::string& listen = "127.0.0.1:0") const {
    std::vector<std::string> args = {
        "serve", "--listen", listen, "--cert", Files("server").cert.string(), "--key",
        Files("server").key.string(), "--ca", Files("server").ca.string(), "--db", db().string(), "--rounds",
        std::to_string(rounds), "--min-clients", std::to_string(clients), "--log-level", "debug"};
    // Poisson sampling (--sample-rate) draws a round's sites instead of --clients-per-round.
    if (std::find(extra.begin(), extra.end(), "--sample-rate") == extra.end()) {
      args.insert(args.end(), {"--clients-per-round", std::to_string(clients)});
    }
    if (exit_when_done) args.push_back("--exit-when-done");
    args.insert(args.end(), extra.begin(), extra.end());
    // Defaults for what `extra` does not set (a flag may be given only once).
    const std::pair<const char*, std::string> defaults[] = {{"--epochs", "1"},
                                                            {"--batch", "10"},
                                                            {"--lr", "0.05"},
                                                            {"--eval-data", data_.string()},
                                                            {"--round-deadline", "60"}};
    for (const auto& [flag, value] : defaults) {
      if (!eval_data && std::string_view(flag) == "--eval-data") continue;
      if (std::find(extra.begin(), extra.end(), flag) == extra.end()) args.insert(args.end(), {flag, value});
    }
    return args;
  }

  // extra: more flags for estuary-client (a multi-rank site's --ranks, ...).
  std::unique_ptr<ChildProcess> StartClient(const std::string& name, uint16_t port, fs::path data = {},
                                            const std::vector<std::string>& extra = {}) {
    if (port == 0) {
      // StartServer failed (and said why): a client that fails at once, so
      // the test ends instead of reconnecting to nothing until ctest's timeout.
      return std::make_unique<ChildProcess>(std::vector<std::string>{"/bin/sh", "-c", "exit 1"},
                                            dir_ / (name + ".log"));
    }
    if (data.empty()) data = data_;
    const auto files = Files(name);
    std::vector<std::string> argv = {BinaryPath("estuary-client").string(), "--server", fmt::format("127.0.0.1:{}", port),
                                     "--cert", files.cert.string(), "--key", files.key.string(), "--ca",
                                     files.ca.string(), "--data", data.string(), "--max-backoff", "1"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return std::make_unique<ChildProcess>(argv, dir_ / (name + ".log"));
  }
  std::string ClientLog(const std::string& name) const {
    std::ifstream in(dir_ / (name + ".log"));
    return {std::istreambuf_iterator<char>(in), {}};
  }

  int WaitServer() { return server_->Wait(); }
  // Waits, bounded, until the server's log holds `line`.
  bool AwaitLog(const std::string& line, std::chrono::seconds limit = std::chrono::seconds(60)) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
      if (ServerLog().find(line) != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }
  // Waits, bounded, until the round log shows `round` committed.
  bool AwaitCommitted(uint64_t round, std::chrono::seconds limit = std::chrono::seconds(60)) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
      if (auto store = server::Store::OpenReadOnly(db()); store.ok()) {
        auto last = (*store)->LastCommittedRound();
        if (last.ok() && last->has_value() && (*last)->round >= round) return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }
  simulations::ServerProcess& server() { return *server_; }
  std::string ServerLog() const {
    std::ifstream in(dir_ / "server.log");
    return {std::istreambuf_iterator<char>(in), {}};
  }
  fs::path db() const { return dir_ / "rounds.db"; }
  fs::path checkpoints() const { return dir_ / "rounds.db.checkpoints"; }
  const fs::path& data() const { return data_; }
  const fs::path& certs() const { return certs_; }
  const TempDir& dir() const { return dir_; }

  std::unique_ptr<server::Store> OpenStore() {
    auto store = server::Store::OpenReadOnly(db());
    EXPECT_TRUE(store.ok()) << store.status().ToString();
    return store.ok() ? std::move(store).value() : nullptr;
  }

 private:
  TempDir dir_;
  fs::path certs_ = dir_ / "certs";
  fs::path data_ = dir_ / "data";
  std::unique_ptr<simulations::ServerProcess> server_;
};

inline std::map<std::string, server::Participation> ParticipationsByName(server::Store& store, uint64_t round) {
  std::map<std::string, server::Participation> out;
  auto rows = store.Participations(round);
  EXPECT_TRUE(rows.ok());
  for (auto& p : *rows) out[p.client] = p;
  return out;
}

}  // namespace estuary::testing
