// bench/connections: how many mutual-TLS sites one estuary-server holds, and
// what they cost it. For each federation size N it starts a real
// estuary-server child process on 127.0.0.1, connects N agents (client::Agent,
// each with its own certificate and TLS connection, all in this process on
// --client-threads I/O threads, at most --window connecting at once), lets
// the server open one round that selects --select of them, and prints:
//   - connected: the sites the round opened with (the server's log), and
//     answered: the agents that heard the federation complete from the server;
//   - the server's memory (VmRSS when the round committed, VmHWM: its peak),
//     from /proc/PID/status;
//   - handshakes per second (N over the time from the first connect to the
//     last site welcomed) against what OpenSSL's own ECDSA P-256 and X25519
//     rates allow on these cores, measured in this process before each size
//     (bench/tls_crypto_rate.h), printed as a ratio;
//   - the round's overhead: the round log's time from the round opened to its
//     record written at commit, less the selected sites' own work (their
//     Train calls, a few passes over a tiny model, timed here and summed).
//     The sites' I/O (TLS, framing) runs in this process on the same cores
//     and stays in the overhead, so the figure bounds the server's from above.
// It fails (exit 1) unless every site connected and answered and the round
// committed an update from every site it selected.
//   build/bench/connections [--sites 1000,5000,10000] [--select 1000] [--window 128]
//                           [--client-threads 2] [--workdir DIR] [--io-threads 4]
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <regex>
#include <sstream>
#include <thread>

#include "base/asio.h"
#include "base/descriptors.h"
#include "bench/harness.h"
#include "bench/tls_crypto_rate.h"
#include "client/agent.h"
#include "crypto/provision.h"
#include "crypto/tls.h"
#include "models/custom_model.h"
#include "server/store.h"
#include "simulations/server_process.h"

namespace {

using namespace estuary;
namespace fs = std::filesystem;
namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;

struct Options {
  std::vector<uint32_t> sites = {1000, 5000, 10000};
  uint32_t select = 1000;
  uint32_t window = 128;  // the server's default --max-handshakes-per-address
  int client_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  int io_threads = 4;  // the server's --io-threads (its default)
  uint32_t model_floats = 1024;
  int work_passes = 32;
  double timeout_s = 900;
  fs::path workdir;
};

// "VmRSS" and "VmHWM" of /proc/PID/status, in kB (0 when unreadable).
struct Memory {
  uint64_t rss_kb = 0, hwm_kb = 0;
};
Memory MemoryOf(pid_t pid) {
  Memory m;
  std::ifstream in(fmt::format("/proc/{}/status", pid));
  std::string key;
  uint64_t value;
  while (in >> key) {
    if (key == "VmRSS:" && in >> value) m.rss_kb = value;
    if (key == "VmHWM:" && in >> value) m.hwm_kb = value;
  }
  return m;
}

// CPU seconds (user + system) the process has used: /proc/PID/stat's
// utime and stime, in clock ticks.
double CpuSecondsOf(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  const std::string line{std::istreambuf_iterator<char>(in), {}};
  const auto paren = line.rfind(')');  // the command name may hold spaces
  if (paren == std::string::npos) return 0;
  std::istringstream fields(line.substr(paren + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);
  }
  return ticks / double(sysconf(_SC_CLK_TCK));
}

std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  double one = 0, five = 0, fifteen = 0;
  in >> one >> five >> fifteen;
  return fmt::format("{:.2f} {:.2f} {:.2f}", one, five, fifteen);
}

// The sites' work: a few passes of arithmetic over the tiny model, timed.
class TinyTrainer final : public client::Trainer {
 public:
  explicit TinyTrainer(int passes) : passes_(passes) {}
  uint64_t num_examples() const override { return 1; }
  Result<client::Update> Train(std::span<const float> global, const Manifest& manifest, const v1::TaskConfig&,
                               uint64_t round, std::string_view) override {
    const auto start = Clock::now();
    std::vector<float> local(global.begin(), global.end());
    for (int pass = 0; pass < passes_; ++pass) {
      for (float& w : local) w = w * 0.999f + 1e-4f;
    }
    auto update = client::FullUpdate(std::move(local), global, manifest, 1, 0.5, start, round);
    work_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
    ++calls_;
    return update;
  }
  double work_seconds() const { return double(work_ns_.load()) * 1e-9; }
  uint64_t calls() const { return calls_.load(); }

 private:
  const int passes_;
  std::atomic<int64_t> work_ns_{0};
  std::atomic<uint64_t> calls_{0};
};

struct Figures {
  uint32_t sites = 0;
  uint32_t connected_at_open = 0;  // "round 1 open: K of N connected clients selected"
  uint32_t welcomed = 0;           // agents the server welcomed at least once
  uint64_t welcomes = 0;           // all welcomes (a site reconnected: more than one)
  uint32_t answered = 0;           // agents told the federation is complete
  double connect_s = 0;            // first connect to last site's first welcome
  double server_cpu_s = 0, bench_cpu_s = 0;  // CPU over that time: the server's, this process's
  Memory at_commit, peak;          // the server's
  uint64_t selected = 0, updates = 0;
  double round_s = 0, work_s = 0;
  uint64_t trained = 0;
  std::string first_error;
};

std::string SiteName(uint32_t i) { return fmt::format("site-{:05d}", i); }

// Sites 0..n-1.
std::vector<std::string> SiteNames(uint32_t n) {
  std::vector<std::string> names;
  for (uint32_t i = 0; i < n; ++i) names.push_back(SiteName(i));
  return names;
}

// One federation of n sites against a fresh server.
Result<Figures> RunFederation(const Options& o, uint32_t n, const fs::path& model_file,
                              const std::vector<std::shared_ptr<const crypto::Identity>>& identities) {
  const fs::path certs = o.workdir / "certs";
  const fs::path db = o.workdir / fmt::format("rounds-{}.db", n);
  const fs::path log = o.workdir / fmt::format("server-{}.log", n);
  std::error_code ec;
  for (const char* suffix : {"", "-wal", "-shm"}) fs::remove(db.string() + suffix, ec);
  fs::remove_all(db.string() + ".checkpoints", ec);
  const uint32_t select = std::min(o.select, n);
  simulations::ServerProcess server;
  ESTUARY_RETURN_IF_ERROR(server.Spawn(
      simulations::FindServerBinary(),
      {"serve", "--listen", "127.0.0.1:0", "--cert", (certs / "server.pem").string(), "--key",
       (certs / "server.key").string(), "--ca", (certs / "ca.pem").string(), "--db", db.string(), "--rounds", "1",
       "--clients-per-round", std::to_string(select), "--min-clients", std::to_string(n), "--initial-model",
       model_file.string(), "--epochs", "1", "--lr", "0.1", "--round-deadline", "600", "--io-threads",
       std::to_string(o.io_threads), "--exit-when-done", "--log-level", "info"},
      log));
  const pid_t pid = server.pid();
  ESTUARY_ASSIGN_OR_RETURN(const uint16_t port, server.WaitForPort());
  ESTUARY_ASSIGN_OR_RETURN(auto tls, crypto::MakeTrustOnlyClientContext(certs / "ca.pem"));

  Figures f;
  f.sites = n;
  TinyTrainer trainer(o.work_passes);
  asio::thread_pool training(2);
  std::vector<std::unique_ptr<asio::io_context>> ios;
  for (int t = 0; t < o.client_threads; ++t) ios.push_back(std::make_unique<asio::io_context>());
  std::vector<std::shared_ptr<client::Agent>> agents;
  std::vector<uint8_t> welcomed_once(n, 0);  // each index touched only on its agent's I/O thread
  std::atomic<uint32_t> welcomed{0}, answered{0}, finished{0}, next{0};
  std::atomic<uint64_t> welcomes{0};
  std::atomic<bool> commit_seen{false};
  std::atomic<int64_t> last_welcome_ns{0};
  std::mutex mu;
  const double server_cpu_start = CpuSecondsOf(pid), bench_cpu_start = CpuSecondsOf(getpid());
  const auto start = Clock::now();
  auto start_next = [&] {
    if (const uint32_t i = next.fetch_add(1); i < n) {
      asio::post(*ios[i % ios.size()], [agent = agents[i]] { agent->Start(); });
    }
  };
  for (uint32_t i = 0; i < n; ++i) {
    client::AgentOptions options;
    options.port = port;
    options.tls = tls;
    options.identity = identities[i];
    options.keep_model = false;
    options.label = SiteName(i);
    auto agent = std::make_shared<client::Agent>(*ios[i % ios.size()], options, trainer, training.get_executor());
    agent->on_welcome = [&, i] {
      welcomes.fetch_add(1);
      if (welcomed_once[i]) return;
      welcomed_once[i] = 1;
      last_welcome_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
      if (welcomed.fetch_add(1) + 1 == n) {
        f.server_cpu_s = CpuSecondsOf(pid) - server_cpu_start;
        f.bench_cpu_s = CpuSecondsOf(getpid()) - bench_cpu_start;
      }
      start_next();  // one fewer connecting: the window moves on
    };
    agent->on_round_closed = [&](const v1::RoundClosed& closed) {
      if (closed.committed() && !commit_seen.exchange(true)) f.at_commit = MemoryOf(pid);
    };
    agent->on_finished = [&](const Status& status) {
      if (status.ok()) {
        answered.fetch_add(1);
      } else {
        std::lock_guard lock(mu);
        if (f.first_error.empty()) f.first_error = status.ToString();
      }
      finished.fetch_add(1);
    };
    agents.push_back(std::move(agent));
  }
  for (uint32_t i = 0; i < std::min(o.window, n); ++i) start_next();
  std::vector<std::thread> threads;
  for (auto& io : ios) threads.emplace_back([&io] { io->run(); });

  // The server's memory, its exit, and a bound on the whole: every agent
  // reconnects for ever to a server that is gone, so they are stopped then.
  std::optional<int> exit_code;
  const auto deadline = start + std::chrono::duration<double>(o.timeout_s);
  std::optional<Clock::time_point> exited_at;
  while (finished.load() < n) {
    if (!exit_code) {
      const Memory m = MemoryOf(pid);
      f.peak.rss_kb = std::max(f.peak.rss_kb, m.rss_kb);
      f.peak.hwm_kb = std::max(f.peak.hwm_kb, m.hwm_kb);
      if ((exit_code = server.Poll())) exited_at = Clock::now();
    }
    const bool gave_up = Clock::now() > deadline || (exited_at && Clock::now() - *exited_at > std::chrono::seconds(10));
    if (gave_up) {
      for (uint32_t i = 0; i < n; ++i) asio::post(*ios[i % ios.size()], [agent = agents[i]] { agent->Stop(); });
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (auto& t : threads) t.join();
  training.join();
  if (!exit_code) exit_code = server.Wait();
  f.welcomed = welcomed;
  f.welcomes = welcomes;
  f.answered = answered;
  f.connect_s = double(last_welcome_ns.load()) * 1e-9;
  f.work_s = trainer.work_seconds();
  f.trained = trainer.calls();
  if (*exit_code != 0) return Aborted("connections: estuary-server exited with status {}; see {}", *exit_code, log.string());

  std::ifstream in(log);
  const std::string text{std::istreambuf_iterator<char>(in), {}};
  std::smatch match;
  if (std::regex_search(text, match, std::regex(R"(round 1 open: \d+ of (\d+) connected clients selected)"))) {
    f.connected_at_open = uint32_t(std::stoul(match[1]));
  }
  ESTUARY_ASSIGN_OR_RETURN(auto store, server::Store::OpenReadOnly(db));
  ESTUARY_ASSIGN_OR_RETURN(const auto rounds, store->Rounds());
  for (const auto& r : rounds) {
    if (r.round != 1 || r.state != server::RoundState::kCommitted) continue;
    f.selected = r.clients_selected;
    f.updates = r.updates_received;
    f.round_s = double(r.ended_ms - r.started_ms) * 1e-3;
  }
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  bench::Bench bench("connections", "one estuary-server and N mutual-TLS sites on 127.0.0.1");
  Options o;
  auto& app = bench.app();
  app.add_option("--sites", o.sites, "federation sizes N")->delimiter(',');
  app.add_option("--select", o.select, "sites the round selects");
  app.add_option("--window", o.window, "sites connecting at once, at most (a load generator's concurrency)");
  app.add_option("--client-threads", o.client_threads, "I/O threads running the agents, each its share of them");
  app.add_option("--io-threads", o.io_threads, "the server's --io-threads");
  app.add_option("--model-floats", o.model_floats, "the tiny model's parameters");
  app.add_option("--work-passes", o.work_passes, "passes a site's training makes over the model");
  app.add_option("--timeout", o.timeout_s, "seconds one federation may take before it is stopped");
  app.add_option("--workdir", o.workdir, "keeps the certificates (reused), round logs and server logs; default: a "
                                         "temporary directory, removed at the end");
  if (auto code = bench.Parse(argc, argv)) return *code;
  spdlog::set_level(spdlog::level::warn);
  const bool temporary = o.workdir.empty();
  if (temporary) o.workdir = fs::temp_directory_path() / fmt::format("estuary-connections-{}", getpid());
  const uint32_t most = *std::max_element(o.sites.begin(), o.sites.end());
  // This process holds one end of every connection, and the server (which
  // inherits the limit) the other.
  if (Status s = EnsureDescriptors(uint64_t(most) + 256); !s.ok()) return bench.Fail(s);

  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  fmt::print("load average at start: {} ({} cores)\n", LoadAverage(), cores);
  bench::Stopwatch provision;
  const fs::path certs = o.workdir / "certs";
  if (Status s = crypto::ProvisionCertificates(certs, {"server"}, 1, {.role = crypto::CertRole::kServer}); !s.ok()) {
    return bench.Fail(s);
  }
  if (Status s = crypto::ProvisionCertificates(certs, SiteNames(most), cores); !s.ok()) return bench.Fail(s);
  auto identities = crypto::LoadIdentities(certs, SiteNames(most), cores);
  if (!identities.ok()) return bench.Fail(identities.status());
  fmt::print("{} site certificates ready in {:.1f} s\n", most, provision.Seconds());
  models::CustomModel model;
  model.layout = {{"w", {int64_t(o.model_floats)}, "F32"}};
  model.manifest.Append("w", {int64_t(o.model_floats)});
  model.values.assign(o.model_floats, 0.5f);
  model.name = models::CustomModelName(model.layout);
  const fs::path model_file = o.workdir / "tiny.safetensors";
  if (Status s = models::SaveCustomModel(model_file, model); !s.ok()) return bench.Fail(s);

  bool all_good = true;
  std::vector<std::string> table;
  for (const uint32_t n : o.sites) {
    auto rates = bench::MeasureCryptoRates(cores);
    if (!rates.ok()) return bench.Fail(rates.status());
    fmt::print("\nN = {} sites (load average {})\n", n, LoadAverage());
    fmt::print("  openssl on {} threads: ECDSA P-256 sign {:.0f}/s, verify {:.0f}/s; X25519 keygen {:.0f}/s, derive "
               "{:.0f}/s (ECDH P-256 derive {:.0f}/s)\n",
               rates->threads, rates->ecdsa_sign, rates->ecdsa_verify, rates->x25519_keygen, rates->x25519_derive,
               rates->p256_derive);
    auto figures = RunFederation(o, n, model_file, *identities);
    if (!figures.ok()) return bench.Fail(figures.status());
    const Figures& f = *figures;
    const double rate = f.connect_s > 0 ? f.welcomed / f.connect_s : 0;
    const double overhead = f.round_s - f.work_s;
    fmt::print("  connected: {} of {} (round 1 opened with {} connected); welcomes {} ({} reconnections); answered "
               "{} of {}\n",
               f.welcomed, n, f.connected_at_open, f.welcomes, f.welcomes - f.welcomed, f.answered, n);
    fmt::print("  handshakes: {} in {:.2f} s = {:.0f}/s; openssl allows {:.0f}/s with both ends on these cores "
               "({:.0f}/s for the server's end alone)\n",
               f.welcomed, f.connect_s, rate, rates->BothEndsBound(), rates->ServerBound());
    bench::PrintRatio("handshakes/s / openssl's bound, both ends", rate / rates->BothEndsBound());
    fmt::print("  CPU a handshake: server {:.2f} ms, sites (this process) {:.2f} ms; openssl's operations {:.2f} ms "
               "an end: {:.0f} % of the server's\n",
               1e3 * f.server_cpu_s / n, 1e3 * f.bench_cpu_s / n, 1e3 * rates->cpu_seconds_per_end,
               100 * rates->cpu_seconds_per_end * n / std::max(f.server_cpu_s, 1e-9));
    fmt::print("  server memory: VmRSS {:.0f} MB at commit, VmHWM {:.0f} MB ({:.1f} KB a site)\n",
               f.at_commit.rss_kb / 1024.0, f.peak.hwm_kb / 1024.0, double(f.peak.hwm_kb) / n);
    fmt::print("  round 1: {} selected, {} updates committed; open to commit {:.3f} s, the sites' own work {:.3f} s "
               "({} Train calls); overhead {:.3f} s\n",
               f.selected, f.updates, f.round_s, f.work_s, f.trained, overhead);
    if (!f.first_error.empty()) fmt::print("  first agent error: {}\n", f.first_error);
    table.push_back(fmt::format("| {} | {} | {} | {:.0f} | {:.0f} | {:.0f} | {:.2f} | {:.3f} | {} |", n,
                                f.connected_at_open, f.answered, f.peak.hwm_kb / 1024.0, rate, rates->BothEndsBound(),
                                rate / rates->BothEndsBound(), overhead, LoadAverage()));
    const bool good = f.welcomed == n && f.connected_at_open == n && f.answered == n && f.selected == std::min(o.select, n) &&
                      f.updates == f.selected;
    if (!good) fmt::print("  FAILED: not every site connected and answered, or the round did not commit every update\n");
    all_good &= good;
  }
  fmt::print("\n| sites | connected | answered | server VmHWM MB | handshakes/s | openssl bound/s | ratio | round "
             "overhead s | load average |\n|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& row : table) fmt::print("{}\n", row);
  if (temporary) {
    std::error_code ec;
    fs::remove_all(o.workdir, ec);
  }
  return all_good ? 0 : 1;
}
