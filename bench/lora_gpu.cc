// bench/lora_gpu: LoRA fine-tuning throughput (cuda::LoraLlamaEngine) against
// full fine-tuning (cuda::LlamaEngine) of the same model on the same GPU, in
// one process, with the ratios, and the device memory each one holds.
//
// Default: the ~124M decoder of bench/llama_gpu (width 768, 12 layers, 12
// heads, SwiGLU 2048, context 1024, vocabulary 50304, tied), bf16, AdamW,
// batch 8 of random tokens (the same batch for every run), 30 timed steps
// after 3 warm-up steps. A step is ForwardBackwardAsync + Step; the host
// waits once, after the last step, to read the loss. Three runs, one after
// the other, each freeing its memory before the next: full fine-tuning, LoRA
// r 8 alpha 16 on q, k, v, o, LoRA on all seven projections, and (under
// bf16) LoRA on q, k, v, o over a base without its fp32 master.
//
// Memory per run: the sum of what the engine allocates for parameters (fp32
// master + bf16 working copy, or the bf16 copy alone; the frozen base's and
// the adapters'), gradients, optimizer state (AdamW: 8 bytes per trained
// parameter) and activations; and, as a check on that sum, the drop in
// cudaMemGetInfo's free memory from before the engine is created to after the
// warm-up (it also counts cuBLAS's workspace and handle, scratch arenas and
// the CUDA context's growth).
//   build/bench/lora_gpu [--batch 8] [--steps 30] [--rank 8] [--alpha 16] [--precision bf16]
#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench/decoder.h"
#include "models/cuda/device.h"
#include "models/cuda/llama_engine.h"
#include "models/cuda/lora_engine.h"
#include "models/cuda/optimizer.h"
#include "models/language_model.h"

namespace {

using namespace estuary;
using namespace estuary::models;

constexpr double kGiB = double(1 << 30);

struct Memory {
  double parameters = 0, gradients = 0, optimizer = 0, activations = 0;  // bytes
  double measured = 0;  // the drop in free device memory
  double total() const { return parameters + gradients + optimizer + activations; }
  std::string ToString() const {
    return fmt::format("parameters {:.3f} + gradients {:.3f} + optimizer {:.3f} + activations {:.3f} = {:.3f} GiB "
                       "(free device memory dropped by {:.3f} GiB)",
                       parameters / kGiB, gradients / kGiB, optimizer / kGiB, activations / kGiB, total() / kGiB,
                       measured / kGiB);
  }
};

struct Run {
  double tokens_per_s = 0, ms_per_step = 0;
  float first_loss = 0, last_loss = 0;
  Memory memory;
};

Result<size_t> FreeDeviceBytes() {
  size_t free = 0, total = 0;
  const cudaError_t error = cudaMemGetInfo(&free, &total);
  if (error != cudaSuccess) {
    return Internal("cudaMemGetInfo failed: {} ({})", cudaGetErrorName(error), cudaGetErrorString(error));
  }
  return free;
}

// Warm-up, then `steps` timed steps; `step` enqueues one, `read_loss` waits.
Status Time(int warmup, int steps, int64_t tokens_per_step, const std::function<Status()>& step,
            const std::function<Result<float>()>& read_loss, size_t free_before, Run& run) {
  for (int i = 0; i < warmup; ++i) ESTUARY_RETURN_IF_ERROR(step());
  ESTUARY_ASSIGN_OR_RETURN(run.first_loss, read_loss());  // also waits for the warm-up
  ESTUARY_ASSIGN_OR_RETURN(const size_t free_after, FreeDeviceBytes());
  run.memory.measured = double(free_before) - double(free_after);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) ESTUARY_RETURN_IF_ERROR(step());
  ESTUARY_ASSIGN_OR_RETURN(run.last_loss, read_loss());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  run.tokens_per_s = double(steps) * double(tokens_per_step) / seconds;
  run.ms_per_step = seconds / steps * 1e3;
  return Status::Ok();
}

struct Setup {
  LlamaConfig config;
  int batch = 8, steps = 30, warmup = 3;
  DType precision = DType::kBF16;
  AdamWOptions adamw;
  std::vector<int32_t> tokens, targets;
};

Result<Run> FullFineTuning(const Setup& s) {
  ESTUARY_ASSIGN_OR_RETURN(const size_t free_before, FreeDeviceBytes());
  cuda::LlamaEngineOptions options;
  options.precision = s.precision;
  ESTUARY_ASSIGN_OR_RETURN(cuda::LlamaEngine engine, cuda::LlamaEngine::Create(s.config, s.batch, options));
  ESTUARY_RETURN_IF_ERROR(engine.Initialize(1));
  ESTUARY_ASSIGN_OR_RETURN(cuda::AdamW opt, cuda::AdamW::Create(engine.parameter_count(), s.adamw, engine.stream()));
  const double n = double(engine.parameter_count());
  Run run;
  run.memory.parameters = n * (4 + (s.precision == DType::kF32 ? 0 : DTypeSize(s.precision)));
  run.memory.gradients = n * 4;
  run.memory.optimizer = n * 8;
  run.memory.activations = double(engine.activation_bytes());
  const int seq = s.config.max_seq_len;
  auto step = [&]() -> Status {
    ESTUARY_RETURN_IF_ERROR(engine.ForwardBackwardAsync(s.tokens.data(), s.targets.data(), s.batch, seq));
    ESTUARY_ASSIGN_OR_RETURN(const bool stepped, engine.Step(opt));
    (void)stepped;  // bf16 and f32 never skip
    return Status::Ok();
  };
  ESTUARY_RETURN_IF_ERROR(
      Time(s.warmup, s.steps, int64_t(s.batch) * seq, step, [&] { return engine.ReadLoss(); }, free_before, run));
  return run;
}

Result<Run> LoraFineTuning(const Setup& s, const LoraConfig& lora, bool base_without_master, int64_t* trainable) {
  ESTUARY_ASSIGN_OR_RETURN(const size_t free_before, FreeDeviceBytes());
  cuda::LlamaEngineOptions options;
  options.precision = s.precision;
  ESTUARY_ASSIGN_OR_RETURN(cuda::LoraLlamaEngine engine, cuda::LoraLlamaEngine::Create(s.config, lora, s.batch, options));
  if (base_without_master) ESTUARY_RETURN_IF_ERROR(engine.base().DropFp32Master());
  ESTUARY_RETURN_IF_ERROR(engine.base().Initialize(1));
  ESTUARY_RETURN_IF_ERROR(engine.Initialize(2));
  ESTUARY_ASSIGN_OR_RETURN(cuda::AdamW opt, cuda::AdamW::Create(engine.parameter_count(), s.adamw, engine.stream()));
  const double adapters = double(engine.parameter_count());
  *trainable = engine.parameter_count();
  const double per_weight = 4 + (s.precision == DType::kF32 ? 0 : DTypeSize(s.precision));
  Run run;
  run.memory.parameters = double(engine.base().parameter_bytes()) + adapters * per_weight;
  run.memory.gradients = adapters * 4;  // the frozen base has no gradient buffer
  run.memory.optimizer = adapters * 8;
  run.memory.activations = double(engine.base().activation_bytes() + engine.adapter_activation_bytes());
  const int seq = s.config.max_seq_len;
  auto step = [&]() -> Status {
    ESTUARY_RETURN_IF_ERROR(engine.ForwardBackwardAsync(s.tokens.data(), s.targets.data(), s.batch, seq));
    ESTUARY_ASSIGN_OR_RETURN(const bool stepped, engine.Step(opt));
    (void)stepped;
    return Status::Ok();
  };
  ESTUARY_RETURN_IF_ERROR(
      Time(s.warmup, s.steps, int64_t(s.batch) * seq, step, [&] { return engine.ReadLoss(); }, free_before, run));
  return run;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"LoRA fine-tuning against full fine-tuning on one GPU (tokens/s and device memory)"};
  Setup s;
  LlamaConfig& c = s.config;
  c = *LlamaPreset("llama-124m");
  int rank = 8;
  float alpha = 16;
  std::string precision = "bf16";
  estuary::bench::AddDecoderOptions(app, c);
  app.add_option("--batch", s.batch);
  app.add_option("--steps", s.steps);
  app.add_option("--warmup", s.warmup);
  app.add_option("--rank", rank);
  app.add_option("--alpha", alpha);
  app.add_option("--precision", precision, "f32 or bf16 (the LoRA engine refuses f16)");
  CLI11_PARSE(app, argc, argv);

  if (Status usable = cuda::CudaUsable(); !usable.ok()) {
    std::printf("lora_gpu: no usable GPU, nothing measured: %s\n", usable.message().c_str());
    return 0;  // a clean exit: there is nothing wrong with the benchmark itself
  }
  auto dtype = ParseDType(precision);
  if (!dtype.ok()) {
    std::fprintf(stderr, "lora_gpu: --precision: %s\n", dtype.status().ToString().c_str());
    return 2;
  }
  if (s.steps < 1 || s.warmup < 1 || s.batch < 1) {
    std::fprintf(stderr, "lora_gpu: --steps %d, --warmup %d and --batch %d must each be at least 1\n", s.steps,
                 s.warmup, s.batch);
    return 2;
  }
  s.precision = *dtype;
  s.adamw.lr = 3e-4f;
  const int seq = c.max_seq_len;
  s.tokens.resize(size_t(s.batch) * seq);
  s.targets.resize(s.tokens.size());
  std::mt19937 rng(7);
  for (auto& t : s.tokens) t = int32_t(rng() % uint32_t(c.vocab_size));
  for (auto& t : s.targets) t = int32_t(rng() % uint32_t(c.vocab_size));
  auto fail = [](const Status& st) {
    std::fprintf(stderr, "lora_gpu: %s\n", st.ToString().c_str());
    return 1;
  };

  auto full = FullFineTuning(s);
  if (!full.ok()) return fail(full.status());
  const double n = double(LayoutOf(c).manifest.total_elements);
  std::printf("full fine-tuning (LlamaEngine, %s): %.1fM trainable, batch %d x %d, %d steps: %.0f tokens/s, "
              "%.1f ms/step (loss %.4f -> %.4f)\n  memory: %s\n",
              precision.c_str(), n / 1e6, s.batch, seq, s.steps, full->tokens_per_s, full->ms_per_step,
              full->first_loss, full->last_loss, full->memory.ToString().c_str());

  struct Variant {
    const char* name;
    std::vector<std::string> targets;
    bool base_in_bf16 = false;  // the base without its fp32 master (bf16 only)
  };
  std::vector<Variant> variants = {
      {"q,k,v,o", {"q_proj", "k_proj", "v_proj", "o_proj"}},
      {"all 7", {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}},
  };
  if (s.precision == DType::kBF16) variants.push_back({"q,k,v,o, base in bf16", variants[0].targets, true});
  std::vector<std::string> ratios;
  for (const Variant& v : variants) {
    LoraConfig lora;
    lora.rank = rank;
    lora.alpha = alpha;
    lora.target_modules = v.targets;
    int64_t trainable = 0;
    auto run = LoraFineTuning(s, lora, v.base_in_bf16, &trainable);
    if (!run.ok()) return fail(run.status());
    std::printf("LoRA r %d alpha %g on %s (LoraLlamaEngine, %s): %.2fM trainable (%.2f%%), %d steps: %.0f tokens/s, "
                "%.1f ms/step (loss %.4f -> %.4f)\n  memory: %s\n",
                rank, double(alpha), v.name, precision.c_str(), double(trainable) / 1e6, 100.0 * double(trainable) / n,
                s.steps, run->tokens_per_s, run->ms_per_step, run->first_loss, run->last_loss,
                run->memory.ToString().c_str());
    ratios.push_back(fmt::format("ratio (LoRA {} / full fine-tuning): tokens/s {:.2f}, memory {:.2f} (measured {:.2f})",
                                 v.name, run->tokens_per_s / full->tokens_per_s, run->memory.total() / full->memory.total(),
                                 run->memory.measured / full->memory.measured));
  }
  for (const std::string& line : ratios) std::printf("%s\n", line.c_str());
  return 0;
}
