// bench/llama_gpu: training throughput of cuda::LlamaEngine on one GPU, and
// the same model in PyTorch (bench/torch_llama_gpu.py: eager with eager and
// with sdpa attention, and torch.compile; bf16 autocast, fused AdamW) run
// afterwards, with the ratios.
//
// Default: the ~124M GPT-2-sized decoder (width 768, 12 layers, 12 heads,
// SwiGLU 2048, context 1024, vocabulary 50304, tied), bf16, AdamW, batch 8,
// 50 timed steps after 3 warm-up steps. A step is ForwardBackwardAsync + Step;
// the host waits only once, after the last step, to read the loss.
//
// MFU = achieved FLOP/s / kPeakBf16: per token 6 N (N = all parameters) for
// the matrix products with the weights, plus 12 L D S for attention's two
// seq x seq products forward and backward (counted over the full square,
// which is what the engine computes). kPeakBf16 is the H100 SXM's dense bf16
// tensor-core peak from NVIDIA's datasheet; on another GPU pass --peak-tflops.
//   build/bench/llama_gpu [--batch 8] [--steps 50] [--precision bf16] [--no-torch] [--flash]
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "bench/decoder.h"
#include "models/cuda/device.h"
#include "models/cuda/llama_engine.h"
#include "models/cuda/optimizer.h"
#include "models/language_model.h"

namespace {
constexpr double kPeakBf16 = 989.4e12;  // H100 SXM5, dense bf16, FLOP/s
}

int main(int argc, char** argv) {
  using namespace estuary;
  using namespace estuary::models;
  CLI::App app{"LlamaEngine training throughput on one GPU vs PyTorch"};
  LlamaConfig c = *LlamaPreset("llama-124m");
  int batch = 8, steps = 50, warmup = 3;
  double peak_tflops = kPeakBf16 / 1e12;
  std::string precision = "bf16", python = "/usr/bin/python3";
  bool no_torch = false;
  estuary::bench::AddDecoderOptions(app, c);
  app.add_option("--batch", batch);
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  app.add_option("--precision", precision, "f32, bf16 or f16");
  app.add_option("--peak-tflops", peak_tflops, "the GPU's dense peak for the chosen precision");
  app.add_option("--python", python);
  app.add_flag("--no-torch", no_torch, "skip the PyTorch comparison");
  bool flash = false;
  app.add_flag("--flash", flash, "the fused flash-attention kernels instead of the materialised path");
  CLI11_PARSE(app, argc, argv);

  if (Status usable = cuda::CudaUsable(); !usable.ok()) {
    std::printf("llama_gpu: no usable GPU, nothing measured: %s\n", usable.message().c_str());
    return 0;  // a clean exit: there is nothing wrong with the benchmark itself
  }
  auto dtype = ParseDType(precision);
  if (!dtype.ok()) {
    std::fprintf(stderr, "llama_gpu: --precision: %s\n", dtype.status().ToString().c_str());
    return 2;
  }
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "llama_gpu: %s\n", s.ToString().c_str());
    return 1;
  };
  cuda::LlamaEngineOptions options;
  options.precision = *dtype;
  options.flash_attention = flash;
  auto engine = cuda::LlamaEngine::Create(c, batch, options);
  if (!engine.ok()) return fail(engine.status());
  if (Status s = engine->Initialize(1); !s.ok()) return fail(s);
  AdamWOptions adamw;
  adamw.lr = 3e-4f;
  auto opt = cuda::AdamW::Create(engine->parameter_count(), adamw, engine->stream());
  if (!opt.ok()) return fail(opt.status());

  const int seq = c.max_seq_len;
  std::vector<int32_t> tokens(size_t(batch) * seq), targets(tokens.size());
  std::mt19937 rng(7);
  for (auto& t : tokens) t = int32_t(rng() % uint32_t(c.vocab_size));
  for (auto& t : targets) t = int32_t(rng() % uint32_t(c.vocab_size));
  auto step = [&]() -> Status {
    ESTUARY_RETURN_IF_ERROR(engine->ForwardBackwardAsync(tokens.data(), targets.data(), batch, seq));
    auto stepped = engine->Step(*opt);
    return stepped.ok() ? Status::Ok() : stepped.status();
  };
  for (int i = 0; i < warmup; ++i) {
    if (Status s = step(); !s.ok()) return fail(s);
  }
  auto first = engine->ReadLoss();  // also waits for the warm-up
  if (!first.ok()) return fail(first.status());
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    if (Status s = step(); !s.ok()) return fail(s);
  }
  auto last = engine->ReadLoss();
  if (!last.ok()) return fail(last.status());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  const double tokens_per_s = double(steps) * batch * seq / seconds;
  const double n = double(engine->parameter_count());
  const double flops_per_token = 6.0 * n + 12.0 * c.num_layers * c.hidden_size * double(seq);
  const double mfu = tokens_per_s * flops_per_token / (peak_tflops * 1e12);
  std::printf("estuary LlamaEngine (%s): %.1fM parameters, batch %d x %d, %d steps: %.0f tokens/s, %.1f ms/step, "
              "MFU %.1f%% of %.1f TFLOP/s (loss %.4f -> %.4f), activations %.2f GiB\n",
              precision.c_str(), n / 1e6, batch, seq, steps, tokens_per_s, seconds / steps * 1e3, mfu * 100,
              peak_tflops, *first, *last, double(engine->activation_bytes()) / (1 << 30));
  if (no_torch) return 0;

  // The engine's and the optimizer's device memory go back before PyTorch starts.
  *opt = cuda::AdamW();
  { const cuda::LlamaEngine released = std::move(*engine); }
  const std::string command = fmt::format(
      "{} {}/bench/torch_llama_gpu.py --vocab {} --hidden {} --intermediate {} --layers {} --heads {} "
      "--kv-heads {} --seq {} --batch {} --steps {} --warmup {}{}",
      python, ESTUARY_SOURCE_DIR, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads,
      c.num_kv_heads, seq, batch, steps, warmup, c.tie_embeddings ? "" : " --untied");
  std::fflush(stdout);
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) {
    std::fprintf(stderr, "llama_gpu: cannot run %s\n", command.c_str());
    return 1;
  }
  double eager = 0, compiled = 0, eager_math = 0;
  char line[1024];
  while (std::fgets(line, sizeof line, pipe)) {
    if (std::sscanf(line, "RESULT %lf %lf %lf", &eager, &compiled, &eager_math) == 3) continue;
    std::fputs(line, stdout);  // PyTorch's own report
  }
  if (pclose(pipe) != 0 || eager <= 0) {
    std::fprintf(stderr, "llama_gpu: the PyTorch run failed: %s\n", command.c_str());
    return 1;
  }
  std::printf("ratio (estuary / pytorch eager, sdpa attention): %.2f\n", tokens_per_s / eager);
  if (eager_math > 0) std::printf("ratio (estuary / pytorch eager, eager attention): %.2f\n", tokens_per_s / eager_math);
  if (compiled > 0) std::printf("ratio (estuary / torch.compile): %.2f\n", tokens_per_s / compiled);
  return 0;
}
