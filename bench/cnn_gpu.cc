// bench/cnn_gpu: many small clients' local training of the MNIST CNN, as a
// federated simulation runs it, on one GPU (cuda::ClassifierEngine) and on the
// CPU backend (models::MakeModel("cnn")) in the same process, with the ratio.
//
// Default: 100 clients x 80 examples x 1 epoch, batch 10, plain SGD (lr 0.05).
// Each client starts from the same global weights, trains its slice and hands
// its weights back to the host, as a client computing its update would:
//   GPU: CopyParametersFrom, ForwardBackwardAsync + Step per batch, CopyParametersTo,
//        clients one after another on one engine;
//   CPU: the simulator's setup: one model per worker thread, OpenBLAS single
//        threaded, clients spread over --threads workers, TrainStepSgd (the
//        CPU's fused plain-SGD step, what client/trainer.cc uses).
// Data: the MNIST training set from --data (IDX files, see scripts/fetch-mnist)
// when present, else synthetic pixels and labels (throughput does not depend
// on the values). Exits 0 with a message when there is no usable GPU.
//   build/bench/cnn_gpu [--clients 100] [--examples 80] [--batch 10] [--threads N] [--precision f32]
#include <CLI/CLI.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <thread>
#include <vector>

#include "models/cuda/classifier_engine.h"
#include "models/cuda/device.h"
#include "models/cuda/optimizer.h"
#include "models/dataset.h"
#include "models/model.h"

extern "C" void openblas_set_num_threads(int);

namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

}  // namespace

int main(int argc, char** argv) {
  using namespace estuary;
  using namespace estuary::models;
  CLI::App app{"MNIST CNN: many small clients' local training on one GPU vs the CPU backend"};
  int clients = 100, examples = 80, batch = 10, epochs = 1;
  int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  float lr = 0.05f;
  std::string data = ESTUARY_SOURCE_DIR "/data/mnist", precision = "f32";
  app.add_option("--clients", clients)->check(CLI::PositiveNumber);
  app.add_option("--examples", examples, "examples per client")->check(CLI::PositiveNumber);
  app.add_option("--batch", batch)->check(CLI::PositiveNumber);
  app.add_option("--epochs", epochs)->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "CPU worker threads (one client per thread at a time)")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", lr);
  app.add_option("--data", data, "directory with the MNIST IDX files");
  app.add_option("--precision", precision, "GPU precision: f32 or bf16");
  CLI11_PARSE(app, argc, argv);

  if (Status usable = cuda::CudaUsable(); !usable.ok()) {
    std::printf("cnn_gpu: no usable GPU, nothing measured: %s\n", usable.message().c_str());
    return 0;  // a clean exit: there is nothing wrong with the benchmark itself
  }
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "cnn_gpu: %s\n", s.ToString().c_str());
    return 1;
  };
  auto dtype = ParseDType(precision);
  if (!dtype.ok()) return fail(dtype.status());

  // Client c trains examples [c * examples, (c + 1) * examples), wrapping around the set.
  const uint64_t needed = uint64_t(clients) * uint64_t(examples);
  Dataset set;
  std::string source;
  if (std::filesystem::exists(std::filesystem::path(data) / "train-images-idx3-ubyte")) {
    auto loaded = LoadIdx(data, Split::kTrain);
    if (!loaded.ok()) return fail(loaded.status());
    set = std::move(*loaded);
    source = "MNIST from " + data;
  } else {
    set.feature_size = 784;
    const uint64_t size = std::min<uint64_t>(needed, 60000);
    set.features.resize(size * 784);
    set.labels.resize(size);
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> pixel(0.0f, 1.0f);
    for (float& v : set.features) v = pixel(rng);
    for (int32_t& v : set.labels) v = int32_t(rng() % 10);
    source = "synthetic (no IDX files in " + data + ")";
  }
  if (set.feature_size != 784 || set.size() == 0) return fail(InvalidArgument("expected 28x28 images"));
  // Each client's examples, contiguous, so both backends read the same batches.
  std::vector<float> client_x(needed * 784);
  std::vector<int32_t> client_y(needed);
  for (uint64_t i = 0; i < needed; ++i) {
    const uint64_t src = i % set.size();
    std::copy(set.row(src), set.row(src) + 784, client_x.data() + i * 784);
    client_y[i] = set.labels[src];
  }

  auto reference = MakeModel("cnn");
  if (!reference.ok()) return fail(reference.status());
  (*reference)->Initialize(1);
  const std::vector<float> global((*reference)->parameters().begin(), (*reference)->parameters().end());
  const int per_epoch = (examples + batch - 1) / batch, steps_per_client = epochs * per_epoch;
  // Step s of a client trains its batch s % per_epoch; the last one of an epoch may be short.
  auto batch_size = [&](int step) { return std::min(batch, examples - (step % per_epoch) * batch); };
  auto batch_offset = [&](int client, int step) {
    return uint64_t(client) * uint64_t(examples) + uint64_t(step % per_epoch) * uint64_t(batch);
  };

  // ------------------------------------------------------------------ GPU
  cuda::ClassifierEngineOptions options;
  options.precision = *dtype;
  auto engine = cuda::ClassifierEngine::Create("cnn", batch, options);
  if (!engine.ok()) return fail(engine.status());
  auto sgd = cuda::Sgd::Create(engine->parameter_count(), lr, 0.0f, 0.0f);
  if (!sgd.ok()) return fail(sgd.status());
  std::vector<float> local(global.size());
  double gpu_last_loss = 0;
  auto gpu_client = [&](int c) -> Status {
    ESTUARY_RETURN_IF_ERROR(engine->CopyParametersFrom(global));
    sgd->Reset();
    for (int step = 0; step < steps_per_client; ++step) {
      const uint64_t at = batch_offset(c, step);
      ESTUARY_RETURN_IF_ERROR(
          engine->ForwardBackwardAsync(client_x.data() + at * 784, client_y.data() + at, batch_size(step)));
      ESTUARY_RETURN_IF_ERROR(engine->Step(*sgd));
    }
    ESTUARY_ASSIGN_OR_RETURN(const float loss, engine->ReadLoss());
    gpu_last_loss += loss;
    return engine->CopyParametersTo(local);
  };
  if (Status s = gpu_client(0); !s.ok()) return fail(s);  // warm-up: cuBLAS heuristics, first launches
  gpu_last_loss = 0;
  auto start = Clock::now();
  for (int c = 0; c < clients; ++c) {
    if (Status s = gpu_client(c); !s.ok()) return fail(s);
  }
  const double gpu_seconds = Seconds(start);

  // ------------------------------------------------------------------ CPU
  openblas_set_num_threads(1);
  const int workers = std::min(threads, clients);
  std::vector<std::unique_ptr<Model>> replicas;
  for (int w = 0; w < workers; ++w) {
    auto m = MakeModel("cnn");
    if (!m.ok()) return fail(m.status());
    replicas.push_back(std::move(*m));
  }
  std::vector<double> cpu_loss(clients, 0.0);
  auto cpu_client = [&](Model& model, int c) {
    std::copy(global.begin(), global.end(), model.parameters().begin());
    float loss = 0;
    for (int step = 0; step < steps_per_client; ++step) {
      const uint64_t at = batch_offset(c, step);
      loss = model.TrainStepSgd(client_x.data() + at * 784, client_y.data() + at, batch_size(step), lr, 0.0f);
    }
    cpu_loss[c] = loss;
    std::vector<float> out(model.parameters().begin(), model.parameters().end());  // the hand-back
  };
  cpu_client(*replicas[0], 0);  // warm-up: arena growth, page faults
  std::atomic<int> next{0};
  start = Clock::now();
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w) {
    pool.emplace_back([&, w] {
      for (int c = next++; c < clients; c = next++) cpu_client(*replicas[w], c);
    });
  }
  for (auto& t : pool) t.join();
  const double cpu_seconds = Seconds(start);
  double cpu_last_loss = 0;
  for (double l : cpu_loss) cpu_last_loss += l;

  const double samples = double(needed) * epochs;
  const double gpu_rate = samples / gpu_seconds, cpu_rate = samples / cpu_seconds;
  std::printf("cnn_gpu: %d clients x %d examples x %d epoch(s), batch %d, data: %s\n", clients, examples, epochs,
              batch, source.c_str());
  std::printf("GPU ClassifierEngine (%s): %.0f samples/s (%.3f s, mean last loss %.4f)\n", precision.c_str(),
              gpu_rate, gpu_seconds, gpu_last_loss / clients);
  std::printf("CPU backend (%d threads): %.0f samples/s (%.3f s, mean last loss %.4f)\n", workers, cpu_rate,
              cpu_seconds, cpu_last_loss / clients);
  std::printf("ratio GPU / CPU: %.2fx\n", gpu_rate / cpu_rate);
  return 0;
}
