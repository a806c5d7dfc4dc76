// bench/lora_base_bf16: LoRA fine-tuning on the CPU with the frozen base kept
// in bf16 (LoraLlama::StoreBaseInBf16) against the same model with an fp32
// base, in one process: the bytes the base holds and the step time, and
// their ratios. With a bf16 base the bytes are the bf16 copy plus the fp32
// pages resident at each layer's gradient report (measured, mincore), and at
// most that plus the units open at once (at the turn from forward to
// backward: the last block, the final norm and the head, which for a tied
// model is the embedding).
//   build/bench/lora_base_bf16 [--preset llama-124m] [--seq 128] [--batch 1] [--steps 5] [--threads 1]
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "bench/decoder.h"
#include "bench/harness.h"
#include "models/flat_buffer.h"
#include "models/language_model.h"
#include "models/lora.h"
#include "models/optimizer.h"

namespace {

using namespace estuary;

// The base's resident fp32 bytes at each layer's gradient report, the most of them.
struct Watch : models::StepHooks {
  const models::LoraLlama* model = nullptr;
  size_t most = 0;
  void GradientsFinal(uint64_t) override {
    auto resident = models::ResidentBytes(model->base().parameters());
    if (resident.ok()) most = std::max(most, *resident);
  }
};

struct Measured {
  double seconds = 0;     // mean step
  size_t base_bytes = 0;  // the bf16 copy + the fp32 pages at their most at a layer's gradient report
  size_t peak_bytes = 0;  // ... + the largest unit, open
  float loss = 0;
};

Result<Measured> Run(const models::LlamaConfig& c, bool bf16, int batch, const bench::Repetitions& steps) {
  ESTUARY_ASSIGN_OR_RETURN(models::Llama base, models::Llama::Create(c, batch));
  base.Initialize(1);
  models::LoraConfig lora;  // rank 8 on q, k, v, o
  ESTUARY_ASSIGN_OR_RETURN(models::LoraLlama model, models::LoraLlama::Create(std::move(base), lora));
  model.Initialize(2);
  if (bf16) model.StoreBaseInBf16();
  const int seq = c.max_seq_len;
  const bench::TokenBatch data = bench::RandomTokens(size_t(batch) * seq, c.vocab_size, 7);
  models::AdamW adamw({.lr = 1e-3f});
  Watch watch;
  watch.model = &model;
  Measured m;
  auto step = [&]() -> Status {
    ESTUARY_ASSIGN_OR_RETURN(m.loss, model.ForwardBackward(data.tokens.data(), data.targets.data(), batch, seq,
                                                           {.hooks = &watch}));
    adamw.Step(model.parameters(), model.gradients());
    return Status::Ok();
  };
  ESTUARY_ASSIGN_OR_RETURN(const bench::Samples seconds, bench::Repeat(steps, step));
  m.seconds = seconds.mean();
  m.base_bytes = watch.most + (bf16 ? model.base().parameters().size() * sizeof(uint16_t) : 0);
  // Most open at once: one unit, or at the turn from forward to backward the
  // last block, the final norm and the head (tied: the embedding).
  const std::vector<models::ParameterUnit> units = model.base().units();
  auto bytes = [&](size_t u) { return size_t(units[u].end - units[u].begin) * sizeof(float); };
  size_t most_open = bytes(units.size() - 1) + bytes(units.size() - 2) + (c.tie_embeddings ? bytes(0) : 0);
  for (size_t u = 0; u < units.size(); ++u) most_open = std::max(most_open, bytes(u));
  m.peak_bytes = bf16 ? m.base_bytes + most_open : m.base_bytes;
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  bench::Bench bench("lora_base_bf16", "LoRA on the CPU: a bf16 base against an fp32 base");
  std::string preset = "llama-124m";
  int batch = 1, threads = 1, seq = 128;
  bench::Repetitions steps{.warmup = 1, .timed = 5};
  bench.app().add_option("--preset", preset);
  bench.app().add_option("--batch", batch);
  bench.app().add_option("--seq", seq, "sequence length of every step");
  bench.AddRepetitions(steps);
  bench.AddThreads(threads, "OpenBLAS threads");
  if (auto code = bench.Parse(argc, argv)) return *code;
  openblas_set_num_threads(threads);
  auto config = models::LlamaPreset(preset);
  if (!config.ok()) return bench.Fail(config.status());
  config->max_seq_len = seq;
  auto f32 = Run(*config, false, batch, steps);
  auto bf16 = f32.ok() ? Run(*config, true, batch, steps) : f32;
  if (!bf16.ok()) return bench.Fail(bf16.status());
  const double mib = 1 << 20;
  fmt::print("{}: LoRA rank 8 on q,k,v,o, batch {} x {} tokens, {} steps (mean), {} thread(s)\n", preset, batch, seq,
             steps.timed, threads);
  fmt::print("| base kept in | base bytes at layer reports | at most | ms/step | loss |\n|---|---:|---:|---:|---:|\n");
  fmt::print("| f32 | {:.1f} MiB | {:.1f} MiB | {:.1f} | {:.4f} |\n", f32->base_bytes / mib, f32->peak_bytes / mib,
             1e3 * f32->seconds, f32->loss);
  fmt::print("| bf16 | {:.1f} MiB ({:.2f}x) | {:.1f} MiB ({:.2f}x) | {:.1f} ({:.2f}x) | {:.4f} |\n",
             bf16->base_bytes / mib, double(bf16->base_bytes) / double(f32->base_bytes), bf16->peak_bytes / mib,
             double(bf16->peak_bytes) / double(f32->peak_bytes), 1e3 * bf16->seconds, bf16->seconds / f32->seconds,
             bf16->loss);
  return 0;
}
