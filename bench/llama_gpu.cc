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
//   build/bench/llama_gpu [--batch 8] [--steps 50] [--precision bf16] [--no-torch] [--materialised]
#include <fmt/format.h>

#include <cstdio>
#include <vector>

#include "bench/decoder.h"
#include "bench/gpu.h"
#include "bench/harness.h"
#include "models/cuda/llama_engine.h"
#include "models/cuda/optimizer.h"
#include "models/language_model.h"

namespace {
constexpr double kPeakBf16 = 989.4e12;  // H100 SXM5, dense bf16, FLOP/s
}

int main(int argc, char** argv) {
  using namespace estuary;
  using namespace estuary::models;
  bench::Bench bench("llama_gpu", "LlamaEngine training throughput on one GPU vs PyTorch");
  LlamaConfig c = *LlamaPreset("llama-124m");
  int batch = 8;
  bench::Repetitions steps{.warmup = 3, .timed = 50};
  double peak_tflops = kPeakBf16 / 1e12;
  DType precision = DType::kBF16;
  std::string python = "/usr/bin/python3";
  bool no_torch = false, materialised = false, recompute = false;
  CLI::App& app = bench.app();
  bench::AddDecoderOptions(app, c);
  app.add_option("--batch", batch);
  bench.AddRepetitions(steps);
  bench.AddPrecision(precision, "f32, bf16 or f16");
  app.add_option("--peak-tflops", peak_tflops, "the GPU's dense peak for the chosen precision");
  bench.AddPython(python);
  app.add_flag("--no-torch", no_torch, "skip the PyTorch comparison");
  app.add_flag("--materialised", materialised,
               "cuBLAS products around a fused softmax instead of the fused flash-attention kernels");
  app.add_flag("--recompute", recompute, "keep each block's input only and recompute its activations in backward");
  if (auto code = bench.Parse(argc, argv)) return *code;

  if (auto why = bench::NoUsableGpu()) return bench.NothingMeasured(*why);
  auto training = bench::LlamaTraining::Create(
      c, batch, {.precision = precision, .flash_attention = !materialised, .recompute = recompute});
  if (!training.ok()) return bench.Fail(training.status());
  cuda::LlamaEngine& engine = training->engine;

  const int seq = c.max_seq_len;
  const bench::TokenBatch data = bench::RandomTokens(size_t(batch) * seq, c.vocab_size, 7);
  auto step = [&]() -> Status {
    ESTUARY_RETURN_IF_ERROR(engine.ForwardBackwardAsync(data.tokens.data(), data.targets.data(), batch, seq));
    return engine.Step(training->adamw).status();
  };
  // The host waits only here: for the loss after the warm-up, and after the timed steps.
  std::vector<float> losses;
  auto read_loss = [&]() -> Status {
    ESTUARY_ASSIGN_OR_RETURN(const float loss, engine.ReadLoss());
    losses.push_back(loss);
    return Status::Ok();
  };
  for (int i = 0; i < steps.warmup; ++i) {
    if (Status s = step(); !s.ok()) return bench.Fail(s);
  }
  if (Status s = read_loss(); !s.ok()) return bench.Fail(s);
  auto seconds = bench::SecondsPerCall(steps.timed, step, read_loss);
  if (!seconds.ok()) return bench.Fail(seconds.status());

  const double tokens_per_s = double(batch) * seq / *seconds;
  const double n = double(engine.parameter_count());
  const double flops_per_token = 6.0 * n + 12.0 * c.num_layers * c.hidden_size * double(seq);
  const double mfu = tokens_per_s * flops_per_token / (peak_tflops * 1e12);
  fmt::print("estuary LlamaEngine ({}{}): {:.1f}M parameters, batch {} x {}, {} steps: {:.0f} tokens/s, {:.1f} ms/step, "
             "MFU {:.1f}% of {:.1f} TFLOP/s (loss {:.4f} -> {:.4f}), activations {:.2f} GiB\n",
             DTypeName(precision), recompute ? ", recompute" : "", n / 1e6, batch, seq, steps.timed, tokens_per_s, *seconds * 1e3, mfu * 100,
             peak_tflops, losses.front(), losses.back(), double(engine.activation_bytes()) / (1 << 30));
  if (no_torch) return 0;

  // The engine's and the optimizer's device memory go back before PyTorch starts.
  { const bench::LlamaTraining released = std::move(*training); }
  const std::string command = fmt::format(
      "{} --vocab {} --hidden {} --intermediate {} --layers {} --heads {} --kv-heads {} --seq {} --batch {} --steps {} "
      "--warmup {}{}",
      bench::ScriptCommand(python, "torch_llama_gpu.py"), c.vocab_size, c.hidden_size, c.intermediate_size,
      c.num_layers, c.num_heads, c.num_kv_heads, seq, batch, steps.timed, steps.warmup,
      c.tie_embeddings ? "" : " --untied");
  double eager = 0, compiled = 0, eager_math = 0;
  const Status torch = bench::RunCommand(command, [&](std::string_view line) {
    if (std::sscanf(std::string(line).c_str(), "RESULT %lf %lf %lf", &eager, &compiled, &eager_math) == 3) return;
    fmt::print("{}\n", line);  // PyTorch's own report
  });
  if (!torch.ok()) return bench.Fail(torch);
  if (eager <= 0) return bench.Fail(Internal("the PyTorch run reported no result: {}", command));
  bench::PrintRatio("estuary / pytorch eager, sdpa attention", tokens_per_s / eager);
  if (eager_math > 0) bench::PrintRatio("estuary / pytorch eager, eager attention", tokens_per_s / eager_math);
  if (compiled > 0) bench::PrintRatio("estuary / torch.compile", tokens_per_s / compiled);
  return 0;
}
