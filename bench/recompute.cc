// bench/recompute: activation recompute (Llama::Create(..., recompute)) against
// the plain decoder that keeps every block's activations, in one process:
// the activation arena's bytes (what it maps, and what a full-size step left
// resident, measured with mincore), the process's peak resident memory over
// the model's life (VmHWM, reset between the two runs through
// /proc/self/clear_refs), the step time, and their ratios. Full fine-tuning
// with AdamW, or with --lora LoRA rank 8 on q, k, v, o. The two run one after
// the other, --rounds times in turn (plain first), so that a neighbour's load
// falls on both; memory is the first round's, the step time the mean of the
// rounds' median steps. The loss of both runs is printed: recompute gives the
// plain path's bits.
//   build/bench/recompute [--preset llama-124m | --config bench/models/smollm-135m] [--seq 256] [--batch 1]
//                         [--lora] [--rounds 2] [--steps 5] [--threads 1]
#include <fmt/format.h>

#include <fstream>
#include <optional>
#include <string>

#include "bench/decoder.h"
#include "bench/harness.h"
#include "models/flat_buffer.h"
#include "models/language_model.h"
#include "models/lora.h"
#include "models/optimizer.h"

namespace {

using namespace estuary;

// "VmHWM:" or "VmRSS:" of /proc/self/status, in bytes.
Result<size_t> StatusBytes(std::string_view key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.starts_with(key)) return size_t(std::stoull(line.substr(key.size()))) * 1024;
  }
  return FailedPrecondition("/proc/self/status has no {}", key);
}

// Resets VmHWM to the current resident set (Linux 4.0 and later).
Status ResetPeak() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  if (!clear) return FailedPrecondition("cannot write 5 to /proc/self/clear_refs (resetting the peak resident set)");
  return Status::Ok();
}

struct Measured {
  bench::Samples seconds;     // each round's median step
  size_t arena_bytes = 0;     // what the arena maps
  size_t arena_resident = 0;  // resident after the steps
  size_t peak_rss = 0;        // VmHWM over the run
  size_t rss_before = 0;      // VmRSS before the model was made
  float loss = 0;
};

// Adds the median step to m.seconds; the rest of m is this run's.
Status Run(const models::LlamaConfig& c, bool recompute, bool lora, int batch, const bench::Repetitions& steps,
           Measured& m) {
  ESTUARY_RETURN_IF_ERROR(ResetPeak());
  ESTUARY_ASSIGN_OR_RETURN(m.rss_before, StatusBytes("VmRSS:"));
  ESTUARY_ASSIGN_OR_RETURN(models::Llama base, models::Llama::Create(c, batch, recompute));
  base.Initialize(1);
  const int seq = c.max_seq_len;
  const bench::TokenBatch data = bench::RandomTokens(size_t(batch) * seq, c.vocab_size, 7);
  std::optional<models::LoraLlama> adapted;
  std::optional<models::Llama> full;
  if (lora) {
    ESTUARY_ASSIGN_OR_RETURN(adapted, models::LoraLlama::Create(std::move(base), models::LoraConfig{}));
    adapted->Initialize(2);
  } else {
    full.emplace(std::move(base));
  }
  models::AdamW adamw({.lr = 1e-4f});
  auto step = [&]() -> Status {
    if (adapted) {
      ESTUARY_ASSIGN_OR_RETURN(m.loss, adapted->ForwardBackward(data.tokens.data(), data.targets.data(), batch, seq));
      adamw.Step(adapted->parameters(), adapted->gradients());
    } else {
      ESTUARY_ASSIGN_OR_RETURN(m.loss, full->ForwardBackward(data.tokens.data(), data.targets.data(), batch, seq));
      adamw.Step(full->parameters(), full->gradients());
    }
    return Status::Ok();
  };
  ESTUARY_ASSIGN_OR_RETURN(const bench::Samples seconds, bench::Repeat(steps, step));
  m.seconds.Add(seconds.median());
  const models::Llama& model = adapted ? adapted->base() : *full;
  m.arena_bytes = model.activation_arena().size_bytes();
  ESTUARY_ASSIGN_OR_RETURN(m.arena_resident, models::ResidentBytes(model.activation_arena()));
  ESTUARY_ASSIGN_OR_RETURN(m.peak_rss, StatusBytes("VmHWM:"));
  return Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  bench::Bench bench("recompute", "activation recompute against keeping every block's activations (CPU)");
  std::string preset = "llama-124m", config_dir;
  int batch = 1, threads = 1, seq = 256, rounds = 2;
  bool lora = false;
  bench::Repetitions steps{.warmup = 1, .timed = 5};
  bench.app().add_option("--preset", preset, "a models::LlamaPreset name");
  bench.app().add_option("--config", config_dir, "a directory whose config.json gives the shape (instead of --preset)");
  bench.app().add_option("--batch", batch)->check(bench::AtLeast(1));
  bench.app().add_option("--seq", seq, "sequence length of every step (the arena's context)")->check(bench::AtLeast(1));
  bench.app().add_flag("--lora", lora, "LoRA rank 8 on q, k, v, o instead of full fine-tuning");
  bench.app().add_option("--rounds", rounds, "plain then recompute, this many times")->check(bench::AtLeast(1));
  bench.AddRepetitions(steps);
  bench.AddThreads(threads, "OpenBLAS threads");
  if (auto code = bench.Parse(argc, argv)) return *code;
  openblas_set_num_threads(threads);
  auto config = config_dir.empty() ? models::LlamaPreset(preset) : models::ReadHfConfig(config_dir, seq);
  if (!config.ok()) return bench.Fail(config.status());
  config->max_seq_len = seq;
  const std::string shape = config_dir.empty() ? preset : config_dir;

  Measured plain_first, recompute_first, plain, recompute;
  for (int round = 0; round < rounds; ++round) {
    Status ran = Run(*config, false, lora, batch, steps, round == 0 ? plain_first : plain);
    if (ran.ok()) ran = Run(*config, true, lora, batch, steps, round == 0 ? recompute_first : recompute);
    if (!ran.ok()) return bench.Fail(ran);
  }
  plain.seconds.Add(plain_first.seconds.mean());
  recompute.seconds.Add(recompute_first.seconds.mean());
  // Memory: the first round's (a later one starts with the earlier's freed heap).
  auto keep_memory = [](Measured& into, const Measured& from) {
    into.arena_bytes = from.arena_bytes;
    into.arena_resident = from.arena_resident;
    into.peak_rss = from.peak_rss;
    into.rss_before = from.rss_before;
    into.loss = from.loss;
  };
  keep_memory(plain, plain_first);
  keep_memory(recompute, recompute_first);
  const double mib = 1 << 20;
  fmt::print("{}: {} layers, {}, batch {} x {} tokens, {} rounds of {} steps (mean of medians), {} thread(s)\n", shape,
             config->num_layers, lora ? "LoRA rank 8 on q,k,v,o" : "full fine-tuning (AdamW)", batch, seq, rounds,
             steps.timed, threads);
  fmt::print("| activations | arena mapped | arena resident | peak RSS (VmHWM) | ms/step | loss |\n"
             "|---|---:|---:|---:|---:|---:|\n");
  for (const auto& [name, m] : {std::pair{"kept", &plain}, std::pair{"recomputed", &recompute}}) {
    fmt::print("| {} | {:.1f} MiB | {:.1f} MiB | {:.1f} MiB | {:.1f} | {:.4f} |\n", name, m->arena_bytes / mib,
               m->arena_resident / mib, m->peak_rss / mib, 1e3 * m->seconds.mean(), m->loss);
  }
  fmt::print("(resident before each model was made: {:.1f} MiB and {:.1f} MiB)\n", plain.rss_before / mib,
             recompute.rss_before / mib);
  bench::PrintRatio("recompute / plain",
                    {{"arena", double(recompute.arena_bytes) / double(plain.arena_bytes)},
                     {"peak RSS", double(recompute.peak_rss) / double(plain.peak_rss)},
                     {"step time", recompute.seconds.mean() / plain.seconds.mean()}});
  return 0;
}
