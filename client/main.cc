// estuary-client: one federation site. Connects to the aggregation server
// over mutual TLS, trains when selected, uploads its update, and reconnects
// with backoff when the server goes away, until the federation completes.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "base/asio.h"
#include <cstdio>

#include "base/config_file.h"
#include "base/host_port.h"
#include "base/memory.h"
#include "client/agent.h"
#include "crypto/tls.h"
#include "client/compute.h"
#include "client/text_trainer.h"
#include "models/dataset.h"
#include "models/text_corpus.h"

extern "C" void openblas_set_num_threads(int);

namespace {

int Fail(const estuary::Status& status) {
  std::fprintf(stderr, "estuary-client: %s\n", status.message().c_str());
  return 1;
}

// The site's data decides what it can train: IDX files (images) or text
// files in the fortunes format (documents between `%` lines). "auto" picks
// images when the IDX training files are there.
estuary::Result<std::unique_ptr<estuary::client::Trainer>> MakeTrainer(const std::filesystem::path& dir,
                                                                      const std::string& kind,
                                                                      const estuary::client::Compute& compute) {
  using namespace estuary;
  if (kind != "auto" && kind != "images" && kind != "text") {
    return InvalidArgument("--data-kind '{}': expected auto, images or text", kind);
  }
  std::error_code ec;
  const bool has_idx = std::filesystem::exists(dir / "train-images-idx3-ubyte", ec);
  if (kind == "text" || (kind == "auto" && !has_idx && std::filesystem::is_directory(dir, ec))) {
    ESTUARY_ASSIGN_OR_RETURN(auto sources, models::LoadFortunes(dir, {}));
    auto tokens = std::make_shared<std::vector<int32_t>>();
    for (const auto& source : sources) {  // all of the site's text trains
      tokens->insert(tokens->end(), source.train.begin(), source.train.end());
      tokens->insert(tokens->end(), source.test.begin(), source.test.end());
    }
    spdlog::info("{}: {} text files, {} tokens", dir.string(), sources.size(), tokens->size());
    return std::unique_ptr<client::Trainer>(new client::TextTrainer(std::move(tokens), compute));
  }
  ESTUARY_ASSIGN_OR_RETURN(auto dataset, models::LoadIdx(dir, models::Split::kTrain));
  return std::unique_ptr<client::Trainer>(new client::ClassifierTrainer(std::move(dataset), compute));
}

}  // namespace

int main(int argc, char** argv) {
  using namespace estuary;
  RetainFreedMemory();
  CLI::App app{"estuary-client: a federated learning site"};
  std::string server = "127.0.0.1:7443", config;
  crypto::TlsFiles tls;
  std::string data, data_kind = "auto", device = "cpu", precision = "fp32";
  double max_backoff = 30;
  std::string log_level = "info";
  app.add_option("--config", config, "TOML file with the same keys as these flags");
  app.add_option("--server", server, "aggregation server HOST:PORT");
  app.add_option("--cert", tls.cert, "this site's certificate (PEM)");
  app.add_option("--key", tls.key, "this site's private key (PEM)");
  app.add_option("--ca", tls.ca, "the federation CA certificate (PEM)");
  app.add_option("--data", data, "this site's training data: a directory of IDX files, or of text files");
  app.add_option("--data-kind", data_kind, "auto | images | text");
  app.add_option("--device", device, "where this site trains: cpu | cuda | cuda:N");
  app.add_option("--precision", precision, "fp32 | bf16 | fp16 (bf16 and fp16 need cuda)");
  app.add_option("--max-backoff", max_backoff, "longest wait between reconnection attempts, seconds");
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error");
  int blas_threads = 1;
  app.add_option("--blas-threads", blas_threads, "OpenBLAS threads for local training (small batches: 1 is fastest)");
  CLI11_PARSE(app, argc, argv);
  openblas_set_num_threads(std::max(1, blas_threads));
  if (!config.empty()) {
    if (Status s = ApplyConfigFile(app, config); !s.ok()) return Fail(s);
  }
  spdlog::set_default_logger(spdlog::stderr_color_mt("estuary-client"));
  spdlog::set_level(spdlog::level::from_str(log_level));
  if (tls.cert.empty() || tls.key.empty() || tls.ca.empty() || data.empty()) {
    return Fail(InvalidArgument("--cert, --key, --ca and --data are required"));
  }
  std::string host;
  uint16_t port = 0;
  if (Status s = ParseHostPort(server, &host, &port); !s.ok()) return Fail(InvalidArgument("--server: {}", s.message()));

  auto compute = client::ParseCompute(device, precision);
  if (!compute.ok()) return Fail(compute.status());
  auto trainer = MakeTrainer(data, data_kind, *compute);
  if (!trainer.ok()) return Fail(trainer.status());
  auto context = crypto::MakeClientContext(tls);
  if (!context.ok()) return Fail(context.status());

  boost::asio::io_context io;
  boost::asio::thread_pool training(1);
  client::AgentOptions options;
  options.host = host;
  options.port = port;
  options.tls = *context;
  options.max_backoff_s = max_backoff;
  options.label = tls.cert.stem().string();
  auto agent = std::make_shared<client::Agent>(io, options, **trainer, training.get_executor());
  Status outcome;
  agent->on_round_closed = [&](const v1::RoundClosed& closed) {
    spdlog::info("round {} {}: {} updates{}", closed.round(), closed.committed() ? "committed" : "failed",
                 closed.updates_received(),
                 closed.has_test_metrics() ? fmt::format(", test accuracy {:.4f}", closed.test_accuracy()) : "");
  };
  boost::asio::signal_set signals(io, SIGINT, SIGTERM);
  agent->on_finished = [&](const Status& status) {
    outcome = status;
    signals.cancel();
  };
  signals.async_wait([&](const boost::system::error_code& ec, int) {
    if (!ec) {
      outcome = Aborted("interrupted");
      agent->Stop();
    }
  });
  agent->Start();
  io.run();
  training.join();
  if (!outcome.ok()) return Fail(outcome);
  spdlog::info("federation complete; trained {} rounds", agent->rounds_trained());
  return 0;
}
