// One large update through the real network path, against OpenSSL's AES-GCM
// on one core in the same process.
//
// An estuary-server (server::Server, in this process, its I/O on its own
// threads) runs a federation of one site whose model is llama-124m's flat
// buffer (124M fp32 values, ~500 MB); the site is a real client::Agent over
// loopback mutual TLS whose trainer trains nothing and returns a delta of the
// model's size. What is timed is the upload: from the agent's "uploading"
// (training over, UpdateBegin next) to the server's "committed" (every chunk
// staged — checked against the manifest and digested as it streamed — and the
// transfer digest compared; the fold comes after). Both moments come from the two ends' own log lines,
// read by a sink of this process as they are written.
//
// The baseline is EVP AES-GCM encryption of the same bytes in TLS-record-
// sized pieces (16 KiB, a fresh nonce each) on the trainer's thread, taken in
// every round just before the upload: AES-128-GCM, AES-256-GCM, and for
// reference the transfer digest (XXH3-128) and SHA-256, which it replaced.
// The cipher the connection negotiates is read from a handshake between the
// same server and site contexts; the ratio is against it (and, as a second
// line, against AES-256-GCM). A shared machine's load falls on the wall-time figures (the upload needs
// several threads scheduled in turn), so the bench also gives bytes per CPU
// second: the process's CPU time (both ends, every thread) over the upload,
// against the encrypting thread's over the baseline. --chunk-kib and
// --staging-memory-mib set the server's chunk size and per-upload memory.
#include <openssl/evp.h>
#include <sys/resource.h>
#include <time.h>
#include <openssl/ssl.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>

#include <boost/asio/thread_pool.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "base/asio.h"
#include "bench/harness.h"
#include "client/agent.h"
#include "client/trainer.h"
#include "crypto/certs.h"
#include "crypto/sha256.h"
#include "crypto/transfer_digest.h"
#include "crypto/tls.h"
#include "server/config.h"
#include "server/server.h"

namespace estuary {
namespace {

namespace asio = boost::asio;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// CPU seconds (user + system) of every thread of this process so far.
double ProcessCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const auto seconds = [](const timeval& t) { return double(t.tv_sec) + double(t.tv_usec) * 1e-6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

// CPU seconds of the calling thread so far.
double ThreadCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
}

// Nanoseconds each thread of this process has run, by thread name (threads
// of one name summed): /proc/self/task/*/schedstat, whose first field is the
// time on a CPU.
std::map<std::string, double> ThreadCpuByName() {
  std::map<std::string, double> seconds;
  std::error_code ec;
  for (const auto& task : fs::directory_iterator("/proc/self/task", ec)) {
    std::ifstream comm(task.path() / "comm"), schedstat(task.path() / "schedstat");
    std::string name;
    double ns = 0;
    if (std::getline(comm, name) && (schedstat >> ns)) seconds[name] += ns * 1e-9;
  }
  return seconds;
}

// The moments the two ends log the upload's start and its commit, and the
// process's CPU time then (in all, and by thread name).
class UploadMoments : public spdlog::sinks::base_sink<std::mutex> {
 public:
  std::vector<Clock::time_point> started, committed;
  std::vector<double> started_cpu, committed_cpu;
  std::map<std::string, double> thread_cpu;  // seconds within the uploads, summed over them

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    const std::string_view line(msg.payload.data(), msg.payload.size());
    if (line.find("; uploading") != std::string_view::npos) {
      started.push_back(Clock::now());
      started_cpu.push_back(ProcessCpuSeconds());
      threads_at_start_ = ThreadCpuByName();
    }
    if (line.find("committed after") != std::string_view::npos) {
      committed.push_back(Clock::now());
      committed_cpu.push_back(ProcessCpuSeconds());
      for (const auto& [name, seconds] : ThreadCpuByName()) thread_cpu[name] += seconds - threads_at_start_[name];
    }
    if (msg.level >= spdlog::level::warn) fmt::print(stderr, "{}\n", line);
  }
  void flush_() override {}

 private:
  std::map<std::string, double> threads_at_start_;
};

struct Timed {
  double wall = 0, cpu = 0;  // seconds
};

// Seconds to encrypt `bytes` with `cipher` in 16 KiB records, one thread.
Timed AesGcmSeconds(const EVP_CIPHER* cipher, const uint8_t* bytes, size_t size) {
  constexpr size_t kRecord = 16 << 10;
  std::vector<uint8_t> out(kRecord + 16);
  unsigned char key[32] = {1, 2, 3}, iv[12] = {};
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  EVP_EncryptInit_ex(ctx, cipher, nullptr, key, nullptr);
  const auto start = Clock::now();
  const double cpu = ThreadCpuSeconds();
  for (size_t at = 0, n = 0; at < size; at += kRecord, ++n) {
    std::memcpy(iv, &n, sizeof(n));
    EVP_EncryptInit_ex(ctx, nullptr, nullptr, nullptr, iv);
    int len = 0;
    EVP_EncryptUpdate(ctx, out.data(), &len, bytes + at, int(std::min(kRecord, size - at)));
    EVP_EncryptFinal_ex(ctx, out.data() + len, &len);
    EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, 16, out.data() + kRecord);
  }
  const Timed timed{Seconds(Clock::now() - start), ThreadCpuSeconds() - cpu};
  EVP_CIPHER_CTX_free(ctx);
  return timed;
}

struct Baselines {
  bench::Samples aes128, aes256, digest, sha256;  // GB/s of wall time
  bench::Samples aes128_cpu, aes256_cpu;  // GB per CPU second
  double update_bytes = 0;
};

// Trains nothing: its update is the model's size of small values, and before
// returning it times the baselines over those very bytes.
class SyntheticTrainer : public client::Trainer {
 public:
  explicit SyntheticTrainer(Baselines& baselines) : baselines_(baselines) {}
  uint64_t num_examples() const override { return 1000; }
  Result<client::Update> Train(std::span<const float> global, const Manifest& manifest, const v1::TaskConfig&,
                               uint64_t round, std::string_view) override {
    client::Update update;
    update.num_examples = 1000;
    update.train_loss = 1;
    update.manifest = manifest;
    update.payload.resize(global.size());
    for (size_t i = 0; i < global.size(); ++i) update.payload[i] = 1e-4f * float(int((i * 2654435761u + round) % 2001) - 1000) / 1000.0f;
    const auto* bytes = reinterpret_cast<const uint8_t*>(update.payload.data());
    const size_t size = update.payload.size() * sizeof(float);
    const double gb = double(size) / 1e9;
    baselines_.update_bytes = double(size);
    const Timed aes128 = AesGcmSeconds(EVP_aes_128_gcm(), bytes, size);
    const Timed aes256 = AesGcmSeconds(EVP_aes_256_gcm(), bytes, size);
    baselines_.aes128.Add(gb / aes128.wall);
    baselines_.aes256.Add(gb / aes256.wall);
    baselines_.aes128_cpu.Add(gb / aes128.cpu);
    baselines_.aes256_cpu.Add(gb / aes256.cpu);
    auto start = Clock::now();
    (void)crypto::TransferDigestHex(bytes, size);
    baselines_.digest.Add(gb / Seconds(Clock::now() - start));
    start = Clock::now();
    crypto::Sha256 hasher;
    hasher.Update(bytes, size);
    (void)hasher.Final();
    baselines_.sha256.Add(gb / Seconds(Clock::now() - start));
    return update;
  }

 private:
  Baselines& baselines_;
};

// The TLS 1.3 suite the server and a site negotiate with these contexts.
Result<std::string> NegotiatedCipher(const crypto::TlsFiles& server_files, const crypto::TlsFiles& site_files) {
  ESTUARY_ASSIGN_OR_RETURN(auto server_tls, crypto::MakeServerContext(server_files));
  ESTUARY_ASSIGN_OR_RETURN(auto site_tls, crypto::MakeClientContext(site_files));
  asio::io_context io;
  asio::ip::tcp::acceptor acceptor(io, {asio::ip::make_address("127.0.0.1"), 0});
  asio::ssl::stream<asio::ip::tcp::socket> server(io, *server_tls), site(io, *site_tls);
  site.next_layer().connect(acceptor.local_endpoint());
  acceptor.accept(server.next_layer());
  ESTUARY_RETURN_IF_ERROR(crypto::VerifyServerName(site.native_handle(), "127.0.0.1"));
  boost::system::error_code server_ec, site_ec;
  std::thread other([&] { server.handshake(asio::ssl::stream_base::server, server_ec); });
  site.handshake(asio::ssl::stream_base::client, site_ec);
  other.join();
  if (server_ec || site_ec) return Internal("handshake: {} / {}", server_ec.message(), site_ec.message());
  return std::string(SSL_CIPHER_get_name(SSL_get_current_cipher(site.native_handle())));
}

int Run(int argc, char** argv) {
  bench::Bench bench("upload", "One llama-124m-sized update over loopback mutual TLS against AES-GCM on one core");
  int rounds = 3;
  std::string model = "llama-124m";
  fs::path dir = fs::temp_directory_path() / fmt::format("estuary-upload-{}", getpid());
  uint64_t staging_memory_mib = 256;
  uint32_t chunk_kib = 1024;
  CLI::App& app = bench.app();
  app.add_option("--rounds", rounds, "uploads timed (one a round)")->check(bench::AtLeast(1));
  app.add_option("--model", model, "the federation's model, whose size the update takes");
  app.add_option("--dir", dir, "certificates, round log, checkpoints and the staging spill (removed after)");
  app.add_option("--staging-memory-mib", staging_memory_mib,
                 "the server's per-upload staging memory; a larger update spills to a file (the default, 256, is "
                 "estuary-server's)");
  app.add_option("--chunk-kib", chunk_kib, "the server's chunk size (estuary-server's default: 1024); frames may be "
                 "twice that")->check(bench::AtLeast(1));
  if (auto code = bench.Parse(argc, argv)) return *code;

  auto sink = std::make_shared<UploadMoments>();
  auto logger = std::make_shared<spdlog::logger>("upload", sink);
  logger->set_level(spdlog::level::debug);
  spdlog::set_default_logger(logger);

  std::error_code ec;
  fs::remove_all(dir, ec);
  const fs::path certs = dir / "certs";
  fs::create_directories(certs);
  Status made = crypto::InitCa(certs);
  if (made.ok()) made = crypto::IssueCertificate(certs, "server", {.role = crypto::CertRole::kServer});
  if (made.ok()) made = crypto::IssueCertificate(certs, "site-0");
  if (!made.ok()) return bench.Fail(made);
  const crypto::TlsFiles server_files{certs / "server.pem", certs / "server.key", certs / "ca.pem"};
  const crypto::TlsFiles site_files{certs / "site-0.pem", certs / "site-0.key", certs / "ca.pem"};
  auto cipher = NegotiatedCipher(server_files, site_files);
  if (!cipher.ok()) return bench.Fail(cipher.status());

  server::ServerConfig config;
  config.listen = "127.0.0.1:0";
  config.tls = server_files;
  config.db = dir / "rounds.db";
  config.rounds = uint64_t(rounds);
  config.clients_per_round = 1;
  config.min_clients = 1;
  config.exit_when_done = true;
  config.staging_memory_bytes = staging_memory_mib << 20;
  config.chunk_bytes = chunk_kib << 10;
  config.max_frame_bytes = std::max<uint64_t>(config.max_frame_bytes, 2 * config.chunk_bytes);
  config.federation.mutable_task()->set_model(model);
  auto server = server::Server::Create(config);
  if (!server.ok()) return bench.Fail(server.status());
  Status served;
  std::thread serving([&] {
    pthread_setname_np(pthread_self(), "server-run");  // an I/O thread of the server's too
    served = (*server)->Run();
  });

  Baselines baselines;
  SyntheticTrainer trainer(baselines);
  asio::io_context io;
  asio::thread_pool training(1);
  asio::post(training, [] { pthread_setname_np(pthread_self(), "site-training"); });
  client::AgentOptions options;
  options.port = (*server)->port();
  auto tls = crypto::MakeClientContext(site_files);
  if (!tls.ok()) return bench.Fail(tls.status());
  options.tls = *tls;
  options.keep_model = false;
  options.read_timeout_s = options.write_timeout_s = 600;
  auto agent = std::make_shared<client::Agent>(io, options, trainer, training.get_executor());
  std::optional<Status> finished;
  agent->on_finished = [&](const Status& status) {
    finished = status;
    io.stop();
  };
  agent->Start();
  io.run();
  serving.join();
  training.join();
  if (finished && !finished->ok()) return bench.Fail(*finished);
  if (!served.ok()) return bench.Fail(served);
  if (sink->started.size() != size_t(rounds) || sink->committed.size() != size_t(rounds)) {
    return bench.Fail(Internal("saw {} uploads start and {} commit, not {}", sink->started.size(),
                               sink->committed.size(), rounds));
  }

  const double bytes = baselines.update_bytes;
  bench::Samples upload, upload_cpu;
  for (int i = 0; i < rounds; ++i) {
    upload.Add(bytes / 1e9 / Seconds(sink->committed[i] - sink->started[i]));
    upload_cpu.Add(bytes / 1e9 / (sink->committed_cpu[i] - sink->started_cpu[i]));
  }
  const bool aes128 = cipher->find("AES_128_GCM") != std::string::npos;
  const bench::Samples& negotiated = aes128 ? baselines.aes128 : baselines.aes256;
  fmt::print("update: {} ({:.1f} MB) in chunks of {} KiB, staged {}; negotiated {}\n", model, bytes / 1e6,
             chunk_kib, bytes > double(config.staging_memory_bytes) ? "in a spill file" : "in memory", *cipher);
  const auto line = [](const char* what, const bench::Samples& s) {
    fmt::print("{:<38} {:6.2f} GB/s (range {:.2f}-{:.2f} over {})\n", what, s.median(), s.min(), s.max(), s.size());
  };
  line("upload, agent to committed", upload);
  line("AES-128-GCM encrypt, one core", baselines.aes128);
  line("AES-256-GCM encrypt, one core", baselines.aes256);
  line("XXH3-128 (transfer digest), one core", baselines.digest);
  line("SHA-256, one core", baselines.sha256);
  // On a shared machine the wall-time figures carry its load; bytes per CPU
  // second (every thread of the process: both ends, during the upload) less so.
  line("upload, GB per CPU second", upload_cpu);
  line("AES-128-GCM, GB per CPU second", baselines.aes128_cpu);
  line("AES-256-GCM, GB per CPU second", baselines.aes256_cpu);
  // Where the CPU of the uploads went, by thread (the server names its own;
  // "upload" is this process's main thread: the site's I/O; "server-run"
  // the thread that runs the server, one of its I/O threads).
  std::string by_thread;
  for (const auto& [name, seconds] : sink->thread_cpu) {
    if (seconds < 0.005 * rounds) continue;
    by_thread += fmt::format("{}{} {:.2f}", by_thread.empty() ? "" : ", ", name, seconds / rounds);
  }
  fmt::print("CPU seconds per upload, by thread: {}\n", by_thread);
  const char* suite = aes128 ? "AES-128-GCM" : "AES-256-GCM";
  bench::PrintRatio(fmt::format("upload / {}", suite), upload.median() / negotiated.median());
  bench::PrintRatio(fmt::format("upload / {}, per CPU second", suite),
                    upload_cpu.median() / (aes128 ? baselines.aes128_cpu : baselines.aes256_cpu).median());
  if (aes128) bench::PrintRatio("upload / AES-256-GCM", upload.median() / baselines.aes256.median());
  fs::remove_all(dir, ec);
  return 0;
}

}  // namespace
}  // namespace estuary

int main(int argc, char** argv) { return estuary::Run(argc, argv); }
