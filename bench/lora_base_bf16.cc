// bench/lora_base_bf16: LoRA fine-tuning on the CPU with the frozen base kept
// in bf16 (LoraLlama::StoreBaseInBf16) against the same model with an fp32
// base, in one process: the bytes the base holds and the step time, and
// their ratios. With a bf16 base the bytes are the bf16 copy plus the fp32
// pages resident at each layer's gradient report (measured, mincore), and at
// most that plus the units open at once (at the turn from forward to
// backward: the last block, the final norm and the head, which for a tied
// model is the embedding).
//   build/bench/lora_base_bf16 [--preset llama-124m] [--seq 128] [--batch 1] [--steps 5] [--threads 1]
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "models/flat_buffer.h"
#include "models/language_model.h"
#include "models/lora.h"
#include "models/optimizer.h"

extern "C" void openblas_set_num_threads(int);

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

Result<Measured> Run(const models::LlamaConfig& c, bool bf16, int batch, int steps) {
  ESTUARY_ASSIGN_OR_RETURN(models::Llama base, models::Llama::Create(c, batch));
  base.Initialize(1);
  models::LoraConfig lora;  // rank 8 on q, k, v, o
  ESTUARY_ASSIGN_OR_RETURN(models::LoraLlama model, models::LoraLlama::Create(std::move(base), lora));
  model.Initialize(2);
  if (bf16) model.StoreBaseInBf16();
  const int seq = c.max_seq_len;
  std::vector<int32_t> tokens(size_t(batch) * seq), targets(tokens.size());
  std::mt19937 rng(7);
  for (auto& t : tokens) t = int32_t(rng() % uint32_t(c.vocab_size));
  for (auto& t : targets) t = int32_t(rng() % uint32_t(c.vocab_size));
  models::AdamW adamw({.lr = 1e-3f});
  Watch watch;
  watch.model = &model;
  Measured m;
  for (int step = 0; step <= steps; ++step) {  // step 0 warms up
    const auto start = std::chrono::steady_clock::now();
    ESTUARY_ASSIGN_OR_RETURN(m.loss, model.ForwardBackward(tokens.data(), targets.data(), batch, seq,
                                                           {.hooks = &watch}));
    adamw.Step(model.parameters(), model.gradients());
    if (step > 0) m.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  m.seconds /= steps;
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
  CLI::App app{"LoRA on the CPU: a bf16 base against an fp32 base"};
  std::string preset = "llama-124m";
  int batch = 1, steps = 5, threads = 1;
  app.add_option("--preset", preset);
  app.add_option("--batch", batch);
  app.add_option("--steps", steps);
  app.add_option("--threads", threads);
  int seq = 128;
  app.add_option("--seq", seq, "sequence length of every step");
  CLI11_PARSE(app, argc, argv);
  openblas_set_num_threads(threads);
  auto config = models::LlamaPreset(preset);
  if (!config.ok()) {
    std::fprintf(stderr, "lora_base_bf16: %s\n", config.status().ToString().c_str());
    return 1;
  }
  config->max_seq_len = seq;
  auto f32 = Run(*config, false, batch, steps);
  auto bf16 = f32.ok() ? Run(*config, true, batch, steps) : f32;
  if (!bf16.ok()) {
    std::fprintf(stderr, "lora_base_bf16: %s\n", bf16.status().ToString().c_str());
    return 1;
  }
  const double mib = 1 << 20;
  fmt::print("{}: LoRA rank 8 on q,k,v,o, batch {} x {} tokens, {} steps, {} thread(s)\n", preset, batch, seq, steps,
             threads);
  fmt::print("| base kept in | base bytes at layer reports | at most | ms/step | loss |\n|---|---:|---:|---:|---:|\n");
  fmt::print("| f32 | {:.1f} MiB | {:.1f} MiB | {:.1f} | {:.4f} |\n", f32->base_bytes / mib, f32->peak_bytes / mib,
             1e3 * f32->seconds, f32->loss);
  fmt::print("| bf16 | {:.1f} MiB ({:.2f}x) | {:.1f} MiB ({:.2f}x) | {:.1f} ({:.2f}x) | {:.4f} |\n",
             bf16->base_bytes / mib, double(bf16->base_bytes) / double(f32->base_bytes), bf16->peak_bytes / mib,
             double(bf16->peak_bytes) / double(f32->peak_bytes), 1e3 * bf16->seconds, bf16->seconds / f32->seconds,
             bf16->loss);
  return 0;
}
