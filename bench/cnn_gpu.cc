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
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <random>
#include <thread>
#include <vector>

#include "bench/gpu.h"
#include "bench/harness.h"
#include "models/cuda/classifier_engine.h"
#include "models/cuda/optimizer.h"
#include "models/dataset.h"
#include "models/model.h"

int main(int argc, char** argv) {
  using namespace estuary;
  using namespace estuary::models;
  bench::Bench bench("cnn_gpu", "MNIST CNN: many small clients' local training on one GPU vs the CPU backend");
  CLI::App& app = bench.app();
  int clients = 100, examples = 80, batch = 10, epochs = 1;
  int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  float lr = 0.05f;
  std::string data = ESTUARY_SOURCE_DIR "/data/mnist";
  DType precision = DType::kF32;
  app.add_option("--clients", clients)->check(bench::AtLeast(1));
  app.add_option("--examples", examples, "examples per client")->check(bench::AtLeast(1));
  app.add_option("--batch", batch)->check(bench::AtLeast(1));
  app.add_option("--epochs", epochs)->check(bench::AtLeast(1));
  bench.AddThreads(threads, "CPU worker threads (one client per thread at a time)");
  app.add_option("--lr", lr);
  app.add_option("--data", data, "directory with the MNIST IDX files");
  bench.AddPrecision(precision, "GPU precision: f32 or bf16");
  if (auto code = bench.Parse(argc, argv)) return *code;
  if (auto why = bench::NoUsableGpu()) return bench.NothingMeasured(*why);

  // Client c trains examples [c * examples, (c + 1) * examples), wrapping around the set.
  const uint64_t needed = uint64_t(clients) * uint64_t(examples);
  Dataset set;
  std::string source;
  if (std::filesystem::exists(std::filesystem::path(data) / "train-images-idx3-ubyte")) {
    auto loaded = LoadIdx(data, Split::kTrain);
    if (!loaded.ok()) return bench.Fail(loaded.status());
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
  if (set.feature_size != 784 || set.size() == 0) return bench.Fail(InvalidArgument("expected 28x28 images"));
  // Each client's examples, contiguous, so both backends read the same batches.
  std::vector<float> client_x(needed * 784);
  std::vector<int32_t> client_y(needed);
  for (uint64_t i = 0; i < needed; ++i) {
    const uint64_t src = i % set.size();
    std::copy(set.row(src), set.row(src) + 784, client_x.data() + i * 784);
    client_y[i] = set.labels[src];
  }

  auto reference = MakeModel("cnn");
  if (!reference.ok()) return bench.Fail(reference.status());
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
  options.precision = precision;
  auto engine = cuda::ClassifierEngine::Create("cnn", batch, options);
  if (!engine.ok()) return bench.Fail(engine.status());
  auto sgd = cuda::Sgd::Create(engine->parameter_count(), lr, 0.0f, 0.0f);
  if (!sgd.ok()) return bench.Fail(sgd.status());
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
  if (Status s = gpu_client(0); !s.ok()) return bench.Fail(s);  // warm-up: cuBLAS heuristics, first launches
  gpu_last_loss = 0;
  const bench::Stopwatch gpu_watch;
  for (int c = 0; c < clients; ++c) {
    if (Status s = gpu_client(c); !s.ok()) return bench.Fail(s);
  }
  const double gpu_seconds = gpu_watch.Seconds();

  // ------------------------------------------------------------------ CPU
  openblas_set_num_threads(1);
  const int workers = std::min(threads, clients);
  std::vector<std::unique_ptr<Model>> replicas;
  for (int w = 0; w < workers; ++w) {
    auto m = MakeModel("cnn");
    if (!m.ok()) return bench.Fail(m.status());
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
  const bench::Stopwatch cpu_watch;
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w) {
    pool.emplace_back([&, w] {
      for (int c = next++; c < clients; c = next++) cpu_client(*replicas[w], c);
    });
  }
  for (auto& t : pool) t.join();
  const double cpu_seconds = cpu_watch.Seconds();
  double cpu_last_loss = 0;
  for (double l : cpu_loss) cpu_last_loss += l;

  const double samples = double(needed) * epochs;
  const double gpu_rate = samples / gpu_seconds, cpu_rate = samples / cpu_seconds;
  fmt::print("cnn_gpu: {} clients x {} examples x {} epoch(s), batch {}, data: {}\n", clients, examples, epochs, batch,
             source);
  fmt::print("GPU ClassifierEngine ({}): {:.0f} samples/s ({:.3f} s, mean last loss {:.4f})\n", DTypeName(precision),
             gpu_rate, gpu_seconds, gpu_last_loss / clients);
  fmt::print("CPU backend ({} threads): {:.0f} samples/s ({:.3f} s, mean last loss {:.4f})\n", workers, cpu_rate,
             cpu_seconds, cpu_last_loss / clients);
  bench::PrintRatio("GPU / CPU, samples/s", gpu_rate / cpu_rate);
  return 0;
}
