// bench/llama_step: one training step (forward, loss, backward) of the CPU
// LLaMA decoder against the same model in PyTorch (bench/torch_llama_step.py,
// the plain-torch reference of tests/models/torch_llama.py, fp32), both on the
// same number of threads, and the ratio.
//   build/bench/llama_step [--hidden 256] [--layers 4] [--batch 4] [--seq 128] [--steps 10] [--threads 1]
#include <fmt/format.h>

#include <cstdlib>

#include "bench/decoder.h"
#include "bench/harness.h"
#include "models/llama.h"

using namespace estuary;

int main(int argc, char** argv) {
  bench::Bench bench("llama_step", "the CPU LLaMA training step vs PyTorch");
  models::LlamaConfig c{.vocab_size = 8192, .hidden_size = 256, .intermediate_size = 688, .num_layers = 4,
                        .num_heads = 8, .num_kv_heads = 4, .max_seq_len = 128};
  int batch = 4, threads = 1;
  bench::Repetitions steps{.warmup = 1, .timed = 10};
  std::string python = "/usr/bin/python3";
  bench::AddDecoderOptions(bench.app(), c);
  bench.app().add_option("--batch", batch);
  bench.AddRepetitions(steps);
  bench.AddThreads(threads, "OpenBLAS threads, ours and PyTorch's");
  bench.AddPython(python);
  if (auto code = bench.Parse(argc, argv)) return *code;
  openblas_set_num_threads(threads);

  auto model = models::Llama::Create(c, batch);
  if (!model.ok()) return bench.Fail(model.status());
  model->Initialize(1);
  const int seq = c.max_seq_len;
  const bench::TokenBatch data = bench::RandomTokens(size_t(batch) * seq, c.vocab_size, 7);
  float loss = 0;
  auto seconds = bench::Repeat(steps, [&]() -> Status {
    ESTUARY_ASSIGN_OR_RETURN(loss, model->ForwardBackward(data.tokens.data(), data.targets.data(), batch, seq));
    return Status::Ok();
  });
  if (!seconds.ok()) return bench.Fail(seconds.status());
  const double ours = seconds->median();
  fmt::print("estuary: {} parameters, batch {} x {} tokens, {} thread(s): median step {}, loss {:.4f}\n",
             model->parameters().size(), batch, seq, threads, bench::MedianAndRangeMs(*seconds), loss);

  // torch.set_num_threads bounds torch's own pool, not the OpenBLAS its GEMMs
  // call: without the variable, OpenBLAS runs PyTorch's GEMMs on every core.
  const std::string command = fmt::format(
      "OPENBLAS_NUM_THREADS={} OMP_NUM_THREADS={} {} --vocab {} --hidden {} --intermediate {} --layers {} --heads {} "
      "--kv-heads {} --seq {} --batch {} --steps {} --warmup {} --threads {}",
      threads, threads, bench::ScriptCommand(python, "torch_llama_step.py"), c.vocab_size, c.hidden_size,
      c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, seq, batch, steps.timed, steps.warmup, threads);
  auto out = bench::CommandOutput(command);
  if (!out.ok()) return bench.Fail(out.status());
  const double theirs = std::strtod(out->c_str(), nullptr);
  if (theirs <= 0) return bench.Fail(Internal("the PyTorch run printed no step time: {}", command));
  fmt::print("pytorch: median step {:.1f} ms\n", theirs * 1e3);
  bench::PrintRatio("pytorch / estuary", theirs / ours);
  return 0;
}
