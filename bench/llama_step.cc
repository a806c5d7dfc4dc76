// bench/llama_step: one training step of the CPU LLaMA decoder against the
// same model in PyTorch (bench/torch_llama_step.py, the plain-torch reference
// of tests/models/torch_llama.py, fp32), both on the same number of threads,
// and the ratio.
//
// A full step is forward, loss and backward (every gradient). With
// --lora-rank R it is a LoRA fine-tuning step instead: adapters (PEFT's init,
// alpha --lora-alpha, on --lora-targets) on a frozen base, forward, loss,
// backward, AdamW over the adapters only (models/lora.h; PyTorch: PEFT's
// LoraLinear and torch.optim.AdamW with the same hyperparameters).
//
// Both sides start from the same bits: the bench writes its model (a Hugging
// Face directory, its adapter directory, the tokens) to a temporary directory
// that PyTorch loads. Each side then reports the loss of every step, warm-up
// included, and the bench fails unless they agree within --tolerance
// (relative): the first loss checks the forward on equal weights, the later
// ones the gradients and the optimizer that produced the weights they see.
//
// The two sides take turns, a step each (PyTorch's a child process that
// waits for each request: bench::LineChild), warm-up steps first, so load
// from other processes on a shared machine falls on both alike. The figure is
// the ratio of the two medians of wall-clock step time; the step-by-step
// ratios' median and range, and the ratio of the medians of process CPU time
// per step (each side's own threads: with --threads 1 the measure least moved
// by other processes, which wall-clock time on a busy machine is not;
// OpenBLAS's spinning workers count in it above one thread), come with it.
//   build/bench/llama_step [--hidden 256] [--layers 4] [--batch 4] [--seq 128] [--steps 10] [--threads 1]
//   build/bench/llama_step --hf-config bench/models/smollm-135m --seq 128 --batch 4 --lora-rank 16
//                          [--lora-targets q,k,v,o] [--steps 10]
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <stdlib.h>
#include <time.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>

#include "base/atomic_file.h"
#include "base/split.h"
#include "bench/decoder.h"
#include "bench/harness.h"
#include "models/llama.h"
#include "models/lora.h"
#include "models/optimizer.h"

namespace {

using namespace estuary;

// This process's CPU time, every thread's: with one thread a side, what a
// step costs apart from the time it waited for a core on a busy machine.
double ProcessCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

// The model, its adapters and tokens as PyTorch reads them, in `dir`.
Status WriteModel(const std::filesystem::path& dir, const models::Llama& base, const models::LoraLlama* lora,
                  const bench::TokenBatch& data) {
  ESTUARY_RETURN_IF_ERROR(models::SaveHfCheckpoint(dir, base));
  if (lora) ESTUARY_RETURN_IF_ERROR(models::SaveLoraAdapter(dir / "adapter", *lora));
  const int seq = base.config().max_seq_len;
  auto rows = [&](const std::vector<int32_t>& ids) {
    std::vector<std::string> out;
    for (size_t at = 0; at < ids.size(); at += size_t(seq)) {
      out.push_back(fmt::format("[{}]", fmt::join(ids.begin() + ptrdiff_t(at), ids.begin() + ptrdiff_t(at + seq), ",")));
    }
    return fmt::format("[{}]", fmt::join(out, ","));
  };
  return WriteFileAtomically(dir / "tokens.json",
                             fmt::format(R"({{"tokens": {}, "targets": {}}})", rows(data.tokens), rows(data.targets)));
}

}  // namespace

int main(int argc, char** argv) {
  bench::Bench bench("llama_step", "the CPU LLaMA training step (full, or LoRA with AdamW) vs PyTorch");
  models::LlamaConfig c{.vocab_size = 8192, .hidden_size = 256, .intermediate_size = 688, .num_layers = 4,
                        .num_heads = 8, .num_kv_heads = 4, .max_seq_len = 128};
  int batch = 4, threads = 1, lora_rank = 0;
  float lora_alpha = 0;
  double tolerance = 1e-4;
  std::string lora_targets = "q,k,v,o", hf_config;
  bench::Repetitions steps{.warmup = 1, .timed = 10};
  std::string python = "/usr/bin/python3";
  CLI::App& app = bench.app();
  bench::AddDecoderOptions(app, c);
  app.add_option("--batch", batch)->check(bench::AtLeast(1));
  app.add_flag("--tie", c.tie_embeddings, "the LM head is the embedding (as --hf-config says where given)");
  app.add_option("--hf-config", hf_config, "a directory with a Hugging Face config.json: that model's shape "
                                           "(random weights), at the context --seq (128 unless given)");
  app.add_option("--lora-rank", lora_rank, "0: a full step; R: a LoRA step with rank R adapters and AdamW")
      ->check(bench::AtLeast(0));
  app.add_option("--lora-alpha", lora_alpha, "LoRA's alpha (default 2 x rank)");
  app.add_option("--lora-targets", lora_targets, "the adapted projections: q,k,v,o,gate,up,down or PEFT's names");
  app.add_option("--tolerance", tolerance, "the most the two sides' losses may differ, relative");
  bench.AddRepetitions(steps);
  bench.AddThreads(threads, "OpenBLAS threads, ours and PyTorch's");
  bench.AddPython(python);
  if (auto code = bench.Parse(argc, argv)) return *code;
  openblas_set_num_threads(threads);
  if (!hf_config.empty()) {
    auto published = models::ReadHfConfig(hf_config, app.count("--seq") ? c.max_seq_len : 128);
    if (!published.ok()) return bench.Fail(published.status());
    c = *published;
  }

  auto base = models::Llama::Create(c, batch);
  if (!base.ok()) return bench.Fail(base.status());
  base->Initialize(1);
  std::optional<models::LoraLlama> lora;
  if (lora_rank > 0) {
    models::LoraConfig lc;
    lc.rank = lora_rank;
    lc.alpha = lora_alpha > 0 ? lora_alpha : 2.0f * float(lora_rank);
    lc.target_modules.clear();
    for (std::string name : SplitCommas(lora_targets)) {
      lc.target_modules.push_back(name.ends_with("_proj") || name.empty() ? name : name + "_proj");
    }
    auto made = models::LoraLlama::Create(std::move(*base), lc);
    if (!made.ok()) return bench.Fail(made.status());
    lora.emplace(std::move(*made));
    lora->Initialize(2);
  }
  const models::Llama& model = lora ? lora->base() : *base;
  const int seq = c.max_seq_len;
  const bench::TokenBatch data = bench::RandomTokens(size_t(batch) * seq, c.vocab_size, 7);

  std::string dir = (std::filesystem::temp_directory_path() / "llama_step.XXXXXX").string();
  if (mkdtemp(dir.data()) == nullptr) return bench.Fail(IoError("cannot make a directory under {}", dir));
  struct Remove {
    std::string dir;
    ~Remove() {
      std::error_code ignored;
      std::filesystem::remove_all(dir, ignored);
    }
  } remove{dir};
  if (Status s = WriteModel(dir, model, lora ? &*lora : nullptr, data); !s.ok()) return bench.Fail(s);

  const models::AdamWOptions adamw_options{.lr = 1e-3f, .weight_decay = 1e-2f};
  models::AdamW adamw(adamw_options);
  auto step = [&]() -> Result<float> {
    if (!lora) return base->ForwardBackward(data.tokens.data(), data.targets.data(), batch, seq);
    ESTUARY_ASSIGN_OR_RETURN(const float loss,
                             lora->ForwardBackward(data.tokens.data(), data.targets.data(), batch, seq));
    adamw.Step(lora->parameters(), lora->gradients());
    return loss;
  };

  // torch.set_num_threads bounds torch's own pool, not the OpenBLAS its GEMMs
  // call: without the variable, OpenBLAS runs PyTorch's GEMMs on every core.
  const std::string command = fmt::format(
      "OPENBLAS_NUM_THREADS={} OMP_NUM_THREADS={} {} --model {} --threads {} --lora-rank {} --lora-alpha {} --lr {} "
      "--weight-decay {}",
      threads, threads, bench::ScriptCommand(python, "torch_llama_step.py"), dir, threads, lora_rank,
      lora ? lora->lora_config().alpha : 0.0f, adamw_options.lr, adamw_options.weight_decay);
  const std::string what =
      lora ? fmt::format("LoRA r {} alpha {} on {} + AdamW", lora_rank, lora->lora_config().alpha,
                         fmt::join(lora->lora_config().target_modules, ","))
           : std::string("full (no optimizer)");
  fmt::print("model: {} ({:.1f}M parameters, {} layers, hidden {}, {}/{} heads, vocab {}{}); step: {}; batch {} x {} "
             "tokens, {} thread(s)\n",
             hf_config.empty() ? "llama" : hf_config, double(model.parameters().size()) / 1e6, c.num_layers,
             c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size, c.tie_embeddings ? ", tied" : "", what, batch,
             seq, threads);

  auto child = bench::LineChild::Start(command);
  if (!child.ok()) return bench.Fail(child.status());
  bench::LineChild& torch = **child;
  if (auto ready = torch.Receive(); !ready.ok() || *ready != "ready") {
    return bench.Fail(ready.ok() ? Internal("{} said {:?} instead of ready", command, *ready) : ready.status());
  }
  // One step of ours, then one of PyTorch's, in turn; each side times its own.
  bench::Samples ours, theirs, ratios, ours_cpu, theirs_cpu;
  double largest = 0;  // relative loss difference
  float first = 0, last = 0;
  for (int i = 0; i < steps.warmup + steps.timed; ++i) {
    const bench::Stopwatch watch;
    const double cpu = ProcessCpuSeconds();
    auto loss = step();
    const double seconds = watch.Seconds(), cpu_seconds = ProcessCpuSeconds() - cpu;
    if (!loss.ok()) return bench.Fail(loss.status());
    if (Status s = torch.Send("step"); !s.ok()) return bench.Fail(s);
    auto line = torch.Receive();
    if (!line.ok()) return bench.Fail(line.status());
    double their_seconds = 0, their_cpu = 0, their_loss = 0;
    if (std::sscanf(line->c_str(), "step %lf %lf %lf", &their_seconds, &their_cpu, &their_loss) != 3) {
      return bench.Fail(Internal("{} said {:?} instead of a step's seconds, CPU seconds and loss", command, *line));
    }
    // Both started from the same bits and train alike, so step i's losses agree.
    const double relative = std::abs(double(*loss) - their_loss) / std::max(std::abs(their_loss), 1e-30);
    largest = std::max(largest, relative);
    if (!(relative <= tolerance)) {
      return bench.Fail(Internal("the two sides compute different things: step {}: loss {:.7g} here, {:.7g} in "
                                 "PyTorch ({:.2g} relative, tolerance {:.2g})",
                                 i, *loss, their_loss, relative, tolerance));
    }
    if (i == 0) first = *loss;
    last = *loss;
    if (i < steps.warmup) continue;
    ours.Add(seconds);
    theirs.Add(their_seconds);
    ratios.Add(their_seconds / seconds);
    ours_cpu.Add(cpu_seconds);
    theirs_cpu.Add(their_cpu);
  }
  if (Status s = torch.Finish(); !s.ok()) return bench.Fail(s);
  fmt::print("losses agree: at most {:.2g} relative apart (tolerance {:.2g}) over {} steps, first {:.6f}, last {:.6f}\n",
             largest, tolerance, steps.warmup + steps.timed, first, last);
  fmt::print("estuary: median step {}\npytorch: median step {}\n", bench::MedianAndRangeMs(ours),
             bench::MedianAndRangeMs(theirs));
  fmt::print("step by step, pytorch / estuary: median {:.2f}, range {:.2f}-{:.2f}\n", ratios.median(), ratios.min(),
             ratios.max());
  fmt::print("CPU time per step (process): estuary {}, pytorch {}\n", bench::MedianAndRangeMs(ours_cpu),
             bench::MedianAndRangeMs(theirs_cpu));
  bench::PrintRatio("pytorch / estuary, CPU time medians", theirs_cpu.median() / ours_cpu.median());
  bench::PrintRatio("pytorch / estuary, medians", theirs.median() / ours.median());
  return 0;
}
