// bench/ddp_gpu: what the data-parallel wrapper costs on one GPU. The same
// engine (the ~124M decoder of bench/llama_gpu, bf16, AdamW) trains plain
// (ForwardBackwardAsync + Step, no host wait) and as rank 0 of a one-GPU NCCL
// site (parallel/data_parallel.h) under DDP (25 MB buckets all-reduced from the
// backward hooks on the communicator's stream, a host wait for them, then the
// engine's step) and under ZeRO-1 (the buckets reduce-scattered into the
// shard, AdamW on the shard, the parameters all-gathered, the bf16 working
// copy refreshed), in alternating blocks of steps in this one process; prints
// the median ms/step of each and the ratios (goal <= 1.03).
//   build/bench/ddp_gpu [--batch 8] [--steps 20] [--blocks 3] [--precision bf16]
#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <vector>

#include "parallel/data_parallel.h"
#include "comm/nccl_communicator.h"
#include "models/cuda/device.h"
#include "models/cuda/llama_engine.h"
#include "models/cuda/optimizer.h"
#include "models/language_model.h"

int main(int argc, char** argv) {
  using namespace estuary;
  using namespace estuary::models;
  CLI::App app{"the DDP wrapper's overhead against plain training on one GPU"};
  LlamaConfig c = *LlamaPreset("llama-124m");
  int batch = 8, steps = 20, blocks = 3;
  std::string precision = "bf16";
  app.add_option("--batch", batch);
  app.add_option("--steps", steps, "steps per timed block");
  app.add_option("--blocks", blocks, "blocks of each, alternating");
  app.add_option("--precision", precision, "f32, bf16 or f16");
  CLI11_PARSE(app, argc, argv);
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "ddp_gpu: %s\n", s.ToString().c_str());
    return 1;
  };
  if (Status usable = cuda::CudaUsable(); !usable.ok()) {
    std::printf("ddp_gpu: no usable GPU, nothing measured: %s\n", usable.message().c_str());
    return 0;
  }
  auto dtype = ParseDType(precision);
  if (!dtype.ok()) return fail(dtype.status());

  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return fail(Internal("stream"));
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("ddp_gpu.{}", getpid());
  std::filesystem::create_directories(dir);
  auto comm = comm::ConnectNccl({.address = "file://" + dir.string(), .rank = 0, .size = 1}, 0, stream);
  std::filesystem::remove_all(dir);
  if (!comm.ok()) return fail(comm.status());

  cuda::LlamaEngineOptions options;
  options.precision = *dtype;
  options.stream = stream;
  auto engine = cuda::LlamaEngine::Create(c, batch, options);
  if (!engine.ok()) return fail(engine.status());
  if (Status s = engine->Initialize(1); !s.ok()) return fail(s);
  AdamWOptions adamw;
  adamw.lr = 3e-4f;
  auto opt = cuda::AdamW::Create(engine->parameter_count(), adamw, stream);
  if (!opt.ok()) return fail(opt.status());
  const size_t count = size_t(engine->parameter_count());
  parallel::DataParallelOptions ddp_options, zero1_options;
  ddp_options.device_stream = zero1_options.device_stream = stream;
  zero1_options.stage = parallel::ZeroStage::kZero1;
  const std::span<float> params(engine->parameters(), count), grads(engine->gradients(), count);
  auto dp = parallel::DataParallel::Create(**comm, params, grads, engine->units(), ddp_options);
  if (!dp.ok()) return fail(dp.status());
  auto zero1 = parallel::DataParallel::Create(**comm, params, grads, engine->units(), zero1_options);
  if (!zero1.ok()) return fail(zero1.status());
  auto shard_opt = cuda::AdamW::Create(int64_t((*zero1)->shard_size()), adamw, stream);
  if (!shard_opt.ok()) return fail(shard_opt.status());

  const int seq = c.max_seq_len;
  std::vector<int32_t> tokens(size_t(batch) * seq), targets(tokens.size());
  std::mt19937 rng(7);
  for (auto& t : tokens) t = int32_t(rng() % uint32_t(c.vocab_size));
  for (auto& t : targets) t = int32_t(rng() % uint32_t(c.vocab_size));

  auto plain_step = [&]() -> Status {
    ESTUARY_RETURN_IF_ERROR(engine->ForwardBackwardAsync(tokens.data(), targets.data(), batch, seq));
    return engine->Step(*opt).status();
  };
  auto ddp_step = [&]() -> Status {
    ESTUARY_RETURN_IF_ERROR(engine->ForwardBackwardAsync(tokens.data(), targets.data(), batch, seq,
                                                         (*dp)->MicroBatch(1.0, true)));
    Status stepped;
    ESTUARY_RETURN_IF_ERROR(
        (*dp)->Step([&](std::span<const models::ParameterSlice>) { stepped = engine->Step(*opt).status(); })
            .status());
    return stepped;
  };
  // The three share one engine and its weights; the work a step does, which
  // is what is timed, does not depend on them.
  auto zero1_step = [&]() -> Status {
    ESTUARY_RETURN_IF_ERROR(engine->ForwardBackwardAsync(tokens.data(), targets.data(), batch, seq,
                                                         (*zero1)->MicroBatch(1.0, true)));
    Status stepped;
    ESTUARY_RETURN_IF_ERROR((*zero1)
                                ->Step([&](std::span<const models::ParameterSlice> slices) {
                                  stepped = shard_opt->Step(slices, stream);
                                })
                                .status());
    ESTUARY_RETURN_IF_ERROR(stepped);
    return engine->RefreshWorkingCopy();
  };
  // ms per step over a block, the stream drained before and after.
  auto time_block = [&](const std::function<Status()>& step) -> Result<double> {
    ESTUARY_RETURN_IF_ERROR(engine->ReadLoss().status());
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) ESTUARY_RETURN_IF_ERROR(step());
    ESTUARY_RETURN_IF_ERROR(engine->ReadLoss().status());
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / steps;
  };
  for (int i = 0; i < 3; ++i) {  // warm-up: cuBLAS heuristics, NCCL's first launch
    if (Status s = plain_step(); !s.ok()) return fail(s);
    if (Status s = ddp_step(); !s.ok()) return fail(s);
    if (Status s = zero1_step(); !s.ok()) return fail(s);
  }
  std::vector<double> plain, ddp, z1;
  for (int b = 0; b < blocks; ++b) {
    auto p = time_block(plain_step);
    if (!p.ok()) return fail(p.status());
    auto d = time_block(ddp_step);
    if (!d.ok()) return fail(d.status());
    auto z = time_block(zero1_step);
    if (!z.ok()) return fail(z.status());
    plain.push_back(*p);
    ddp.push_back(*d);
    z1.push_back(*z);
    std::printf("block %d: plain %.2f ms/step, DDP %.2f ms/step, ZeRO-1 %.2f ms/step\n", b, *p, *d, *z);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double mp = median(plain), md = median(ddp), mz = median(z1);
  std::printf("%s, batch %d x %d, %zu buckets: plain %.2f ms/step, over NCCL (1 GPU): DDP %.2f, ZeRO-1 %.2f ms/step\n",
              precision.c_str(), batch, seq, (*dp)->buckets().size(), mp, md, mz);
  std::printf("ratio (DDP / plain): %.3f\n", md / mp);
  std::printf("ratio (ZeRO-1 / plain): %.3f\n", mz / mp);
  dp->reset();
  zero1->reset();
  return 0;
}
