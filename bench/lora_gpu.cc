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
//
// A published model's shape instead (--hf-config DIR: its config.json, read
// as LoadHfCheckpoint reads it, at the context --seq, 1024 unless given;
// random weights), and with --peft the same LoRA under Hugging Face's
// transformers + peft on the same GPU afterwards (bench/torch_peft_gpu.py:
// bf16 base, fp32 adapters, sdpa attention), compared with the run whose base
// is in bf16 as theirs is.
//   build/bench/lora_gpu [--batch 8] [--steps 30] [--rank 8] [--alpha 16] [--precision bf16]
//                        [--hf-config bench/models/smollm-135m --peft [--python python3]]
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench/decoder.h"
#include "bench/gpu.h"
#include "bench/harness.h"
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

struct Setup {
  LlamaConfig config;
  int batch = 8;
  bench::Repetitions steps{.warmup = 3, .timed = 30};
  DType precision = DType::kBF16;
  bench::TokenBatch data;
  std::vector<float> weights;  // drawn once on the host; every run starts from them
};

// Warm-up, then the timed steps; `step` enqueues one, `read_loss` waits.
Status Time(const Setup& s, const std::function<Status()>& step, const std::function<Result<float>()>& read_loss,
            size_t free_before, Run& run) {
  for (int i = 0; i < s.steps.warmup; ++i) ESTUARY_RETURN_IF_ERROR(step());
  ESTUARY_ASSIGN_OR_RETURN(run.first_loss, read_loss());  // also waits for the warm-up
  ESTUARY_ASSIGN_OR_RETURN(const size_t free_after, FreeDeviceBytes());
  run.memory.measured = double(free_before) - double(free_after);
  auto last_loss = [&]() -> Status {
    ESTUARY_ASSIGN_OR_RETURN(run.last_loss, read_loss());
    return Status::Ok();
  };
  ESTUARY_ASSIGN_OR_RETURN(const double seconds, bench::SecondsPerCall(s.steps.timed, step, last_loss));
  run.tokens_per_s = double(s.batch) * double(s.config.max_seq_len) / seconds;
  run.ms_per_step = seconds * 1e3;
  return Status::Ok();
}

Result<Run> FullFineTuning(const Setup& s) {
  ESTUARY_ASSIGN_OR_RETURN(const size_t free_before, FreeDeviceBytes());
  ESTUARY_ASSIGN_OR_RETURN(bench::LlamaTraining training,
                           bench::LlamaTraining::Create(s.config, s.batch,
                                                        {.precision = s.precision, .weights = &s.weights}));
  cuda::LlamaEngine& engine = training.engine;
  const double n = double(engine.parameter_count());
  Run run;
  run.memory.parameters = n * (4 + (s.precision == DType::kF32 ? 0 : DTypeSize(s.precision)));
  run.memory.gradients = n * 4;
  run.memory.optimizer = n * 8;
  run.memory.activations = double(engine.activation_bytes());
  const int seq = s.config.max_seq_len;
  auto step = [&]() -> Status {
    ESTUARY_RETURN_IF_ERROR(engine.ForwardBackwardAsync(s.data.tokens.data(), s.data.targets.data(), s.batch, seq));
    return engine.Step(training.adamw).status();  // bf16 and f32 never skip
  };
  ESTUARY_RETURN_IF_ERROR(Time(s, step, [&] { return engine.ReadLoss(); }, free_before, run));
  return run;
}

Result<Run> LoraFineTuning(const Setup& s, const LoraConfig& lora, bool base_without_master, int64_t* trainable) {
  ESTUARY_ASSIGN_OR_RETURN(const size_t free_before, FreeDeviceBytes());
  cuda::LlamaEngineOptions options;
  options.precision = s.precision;
  ESTUARY_ASSIGN_OR_RETURN(cuda::LoraLlamaEngine engine,
                           cuda::LoraLlamaEngine::Create(s.config, lora, s.batch, options));
  if (base_without_master) ESTUARY_RETURN_IF_ERROR(engine.base().DropFp32Master());
  ESTUARY_RETURN_IF_ERROR(engine.base().CopyParametersFrom(s.weights));
  ESTUARY_RETURN_IF_ERROR(engine.Initialize(2));
  ESTUARY_ASSIGN_OR_RETURN(cuda::AdamW opt,
                           cuda::AdamW::Create(engine.parameter_count(), bench::DecoderAdamW(), engine.stream()));
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
    ESTUARY_RETURN_IF_ERROR(engine.ForwardBackwardAsync(s.data.tokens.data(), s.data.targets.data(), s.batch, seq));
    return engine.Step(opt).status();
  };
  ESTUARY_RETURN_IF_ERROR(Time(s, step, [&] { return engine.ReadLoss(); }, free_before, run));
  return run;
}

}  // namespace

int main(int argc, char** argv) {
  bench::Bench bench("lora_gpu", "LoRA fine-tuning against full fine-tuning on one GPU (tokens/s and device memory)");
  Setup s;
  LlamaConfig& c = s.config;
  c = *LlamaPreset("llama-124m");
  int rank = 8;
  float alpha = 16;
  CLI::App& app = bench.app();
  bench::AddDecoderOptions(app, c);
  app.add_option("--batch", s.batch)->check(bench::AtLeast(1));
  bench.AddRepetitions(s.steps);
  app.add_option("--rank", rank);
  app.add_option("--alpha", alpha);
  bench.AddPrecision(s.precision, "f32 or bf16 (the LoRA engine refuses f16)");
  std::string hf_config, python = "/usr/bin/python3";
  bool peft = false;
  app.add_option("--hf-config", hf_config, "a directory with a Hugging Face config.json: that model's shape");
  app.add_flag("--peft", peft, "also time transformers + peft on the same LoRA (bench/torch_peft_gpu.py)");
  bench.AddPython(python);
  if (auto code = bench.Parse(argc, argv)) return *code;
  if (!hf_config.empty()) {
    auto published = ReadHfConfig(hf_config, app.count("--seq") ? c.max_seq_len : 1024);
    if (!published.ok()) return bench.Fail(published.status());
    c = *published;
  }
  if (peft && hf_config.empty()) {
    return bench.Fail(InvalidArgument("--peft needs --hf-config DIR: transformers builds its model from that config.json"));
  }
  if (peft && s.precision != DType::kBF16) {
    return bench.Fail(InvalidArgument("--peft compares bf16 bases; --precision {} has none", DTypeName(s.precision)));
  }

  if (auto why = bench::NoUsableGpu()) return bench.NothingMeasured(*why);
  // The first loss is read after the warm-up, so there must be one.
  if (s.steps.warmup < 1) return bench.Fail(InvalidArgument("--warmup {}: at least 1", s.steps.warmup));
  const int seq = c.max_seq_len;
  s.data = bench::RandomTokens(size_t(s.batch) * seq, c.vocab_size, 7);
  s.weights.resize(LayoutOf(c).manifest.total_elements);
  InitializeLlamaParameters(LayoutOf(c).manifest, 1, s.weights);

  auto full = FullFineTuning(s);
  if (!full.ok()) return bench.Fail(full.status());
  const double n = double(LayoutOf(c).manifest.total_elements);
  if (!hf_config.empty()) fmt::print("model: {} ({})\n", hf_config, c.architecture);
  fmt::print("full fine-tuning (LlamaEngine, {}): {:.1f}M trainable, batch {} x {}, {} steps: {:.0f} tokens/s, "
             "{:.1f} ms/step (loss {:.4f} -> {:.4f})\n  memory: {}\n",
             DTypeName(s.precision), n / 1e6, s.batch, seq, s.steps.timed, full->tokens_per_s, full->ms_per_step,
             full->first_loss, full->last_loss, full->memory.ToString());

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
  // Printed together after the last run, where they are easy to find.
  std::vector<std::pair<std::string, std::vector<std::pair<std::string, double>>>> ratios;
  Run base_in_bf16;
  for (const Variant& v : variants) {
    LoraConfig lora;
    lora.rank = rank;
    lora.alpha = alpha;
    lora.target_modules = v.targets;
    int64_t trainable = 0;
    auto run = LoraFineTuning(s, lora, v.base_in_bf16, &trainable);
    if (!run.ok()) return bench.Fail(run.status());
    fmt::print("LoRA r {} alpha {} on {} (LoraLlamaEngine, {}): {:.2f}M trainable ({:.2f}%), {} steps: "
               "{:.0f} tokens/s, {:.1f} ms/step (loss {:.4f} -> {:.4f})\n  memory: {}\n",
               rank, alpha, v.name, DTypeName(s.precision), double(trainable) / 1e6, 100.0 * double(trainable) / n,
               s.steps.timed, run->tokens_per_s, run->ms_per_step, run->first_loss, run->last_loss,
               run->memory.ToString());
    ratios.push_back({fmt::format("LoRA {} / full fine-tuning", v.name),
                      {{"tokens/s", run->tokens_per_s / full->tokens_per_s},
                       {"memory", run->memory.total() / full->memory.total()},
                       {"measured memory", run->memory.measured / full->memory.measured}}});
    if (v.base_in_bf16) base_in_bf16 = *run;
  }
  if (peft) {
    const std::string command = fmt::format(
        "{} --config {} --seq {} --batch {} --steps {} --warmup {} --rank {} --alpha {} --targets {}",
        bench::ScriptCommand(python, "torch_peft_gpu.py"), hf_config, seq, s.batch,
        s.steps.timed, s.steps.warmup, rank, alpha, fmt::join(variants[0].targets, ","));
    double tokens_per_s = 0, peak = 0, drop = 0;
    const Status torch = bench::RunCommand(command, [&](std::string_view line) {
      if (std::sscanf(std::string(line).c_str(), "RESULT %lf %lf %lf", &tokens_per_s, &peak, &drop) == 3) return;
      fmt::print("{}\n", line);  // transformers' and peft's own report
    });
    if (!torch.ok()) return bench.Fail(torch);
    if (tokens_per_s > 0) {
      ratios.push_back({"estuary LoRA q,k,v,o, base in bf16 / transformers + peft",
                        {{"tokens/s", base_in_bf16.tokens_per_s / tokens_per_s},
                         {"measured memory", base_in_bf16.memory.measured / drop},
                         {"memory / peft's peak allocated", base_in_bf16.memory.total() / peak}}});
    }
  }
  for (const auto& [compared, figures] : ratios) bench::PrintRatio(compared, figures);
  return 0;
}
