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
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <vector>

#include "bench/decoder.h"
#include "bench/gpu.h"
#include "bench/harness.h"
#include "comm/nccl_communicator.h"
#include "models/cuda/llama_engine.h"
#include "models/cuda/optimizer.h"
#include "models/language_model.h"
#include "parallel/data_parallel.h"

int main(int argc, char** argv) {
  using namespace estuary;
  using namespace estuary::models;
  bench::Bench bench("ddp_gpu", "the DDP wrapper's overhead against plain training on one GPU");
  LlamaConfig c = *LlamaPreset("llama-124m");
  int batch = 8, steps = 20, blocks = 3;
  DType precision = DType::kBF16;
  CLI::App& app = bench.app();
  app.add_option("--batch", batch);
  app.add_option("--steps", steps, "steps per timed block")->check(bench::AtLeast(1));
  app.add_option("--blocks", blocks, "blocks of each, alternating; the median block is reported")
      ->check(bench::AtLeast(1));
  bench.AddPrecision(precision, "f32, bf16 or f16");
  if (auto code = bench.Parse(argc, argv)) return *code;
  if (auto why = bench::NoUsableGpu()) return bench.NothingMeasured(*why);

  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return bench.Fail(Internal("stream"));
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("ddp_gpu.{}", getpid());
  std::filesystem::create_directories(dir);
  auto comm = comm::ConnectNccl({.address = "file://" + dir.string(), .rank = 0, .size = 1}, 0, stream);
  std::filesystem::remove_all(dir);
  if (!comm.ok()) return bench.Fail(comm.status());

  auto training = bench::LlamaTraining::Create(c, batch, {.precision = precision, .stream = stream});
  if (!training.ok()) return bench.Fail(training.status());
  cuda::LlamaEngine& engine = training->engine;
  cuda::AdamW& opt = training->adamw;
  const size_t count = size_t(engine.parameter_count());
  parallel::DataParallelOptions ddp_options, zero1_options;
  ddp_options.device_stream = zero1_options.device_stream = stream;
  zero1_options.stage = parallel::ZeroStage::kZero1;
  const std::span<float> params(engine.parameters(), count), grads(engine.gradients(), count);
  auto dp = parallel::DataParallel::Create(**comm, params, grads, engine.units(), ddp_options);
  if (!dp.ok()) return bench.Fail(dp.status());
  auto zero1 = parallel::DataParallel::Create(**comm, params, grads, engine.units(), zero1_options);
  if (!zero1.ok()) return bench.Fail(zero1.status());
  auto shard_opt = cuda::AdamW::Create(int64_t((*zero1)->shard_size()), bench::DecoderAdamW(), stream);
  if (!shard_opt.ok()) return bench.Fail(shard_opt.status());

  const int seq = c.max_seq_len;
  const bench::TokenBatch data = bench::RandomTokens(size_t(batch) * seq, c.vocab_size, 7);
  const int32_t* tokens = data.tokens.data();
  const int32_t* targets = data.targets.data();

  auto plain_step = [&]() -> Status {
    ESTUARY_RETURN_IF_ERROR(engine.ForwardBackwardAsync(tokens, targets, batch, seq));
    return engine.Step(opt).status();
  };
  auto ddp_step = [&]() -> Status {
    ESTUARY_RETURN_IF_ERROR(engine.ForwardBackwardAsync(tokens, targets, batch, seq,
                                                         (*dp)->MicroBatch(1.0, true)));
    Status stepped;
    ESTUARY_RETURN_IF_ERROR(
        (*dp)->Step([&](std::span<const models::ParameterSlice>) { stepped = engine.Step(opt).status(); })
            .status());
    return stepped;
  };
  // The three share one engine and its weights; the work a step does, which
  // is what is timed, does not depend on them.
  auto zero1_step = [&]() -> Status {
    ESTUARY_RETURN_IF_ERROR(engine.ForwardBackwardAsync(tokens, targets, batch, seq,
                                                         (*zero1)->MicroBatch(1.0, true)));
    Status stepped;
    ESTUARY_RETURN_IF_ERROR((*zero1)
                                ->Step([&](std::span<const models::ParameterSlice> slices) {
                                  stepped = shard_opt->Step(slices, stream);
                                })
                                .status());
    ESTUARY_RETURN_IF_ERROR(stepped);
    return engine.RefreshWorkingCopy();
  };
  // Seconds per step over a block, the stream drained before and after.
  auto drain = [&] { return engine.ReadLoss().status(); };
  auto time_block = [&](const std::function<Status()>& step) -> Result<double> {
    ESTUARY_RETURN_IF_ERROR(drain());
    return bench::SecondsPerCall(steps, step, drain);
  };
  for (int i = 0; i < 3; ++i) {  // warm-up: cuBLAS heuristics, NCCL's first launch
    if (Status s = plain_step(); !s.ok()) return bench.Fail(s);
    if (Status s = ddp_step(); !s.ok()) return bench.Fail(s);
    if (Status s = zero1_step(); !s.ok()) return bench.Fail(s);
  }
  bench::Samples plain, ddp, z1;
  for (int b = 0; b < blocks; ++b) {
    auto p = time_block(plain_step);
    if (!p.ok()) return bench.Fail(p.status());
    auto d = time_block(ddp_step);
    if (!d.ok()) return bench.Fail(d.status());
    auto z = time_block(zero1_step);
    if (!z.ok()) return bench.Fail(z.status());
    plain.Add(*p);
    ddp.Add(*d);
    z1.Add(*z);
    fmt::print("block {}: plain {:.2f} ms/step, DDP {:.2f} ms/step, ZeRO-1 {:.2f} ms/step\n", b, *p * 1e3, *d * 1e3,
               *z * 1e3);
  }
  fmt::print("{}, batch {} x {}, {} buckets: plain {:.2f} ms/step, over NCCL (1 GPU): DDP {:.2f}, "
             "ZeRO-1 {:.2f} ms/step (medians of {} blocks)\n",
             DTypeName(precision), batch, seq, (*dp)->buckets().size(), plain.median() * 1e3, ddp.median() * 1e3,
             z1.median() * 1e3, blocks);
  bench::PrintRatio("DDP / plain", ddp.median() / plain.median(), 3);
  bench::PrintRatio("ZeRO-1 / plain", z1.median() / plain.median(), 3);
  dp->reset();
  zero1->reset();
  return 0;
}
