// bench/llama_step: one training step (forward, loss, backward) of the CPU
// LLaMA decoder against the same model in PyTorch (bench/torch_llama_step.py,
// the plain-torch reference of tests/models/torch_llama.py, fp32), both on the
// same number of threads, and the ratio.
//   build/bench/llama_step [--hidden 256] [--layers 4] [--batch 4] [--seq 128] [--threads 1]
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "bench/decoder_options.h"
#include "models/llama.h"

extern "C" void openblas_set_num_threads(int);

int main(int argc, char** argv) {
  CLI::App app{"the CPU LLaMA training step vs PyTorch"};
  estuary::models::LlamaConfig c;
  c.vocab_size = 8192;
  c.hidden_size = 256;
  c.intermediate_size = 688;
  c.num_layers = 4;
  c.num_heads = 8;
  c.num_kv_heads = 4;
  c.max_seq_len = 128;
  int batch = 4, steps = 10, threads = 1;
  std::string python = "/usr/bin/python3";
  estuary::bench::AddDecoderOptions(app, c);
  app.add_option("--batch", batch);
  app.add_option("--steps", steps);
  app.add_option("--threads", threads);
  app.add_option("--python", python);
  CLI11_PARSE(app, argc, argv);
  openblas_set_num_threads(threads);

  auto model = estuary::models::Llama::Create(c, batch);
  if (!model.ok()) {
    std::fprintf(stderr, "llama_step: %s\n", model.status().ToString().c_str());
    return 1;
  }
  model->Initialize(1);
  const int seq = c.max_seq_len;
  std::vector<int32_t> tokens(size_t(batch) * seq), targets(tokens.size());
  std::mt19937 rng(7);
  for (auto& t : tokens) t = int32_t(rng() % uint32_t(c.vocab_size));
  for (auto& t : targets) t = int32_t(rng() % uint32_t(c.vocab_size));

  std::vector<double> seconds;
  float loss = 0;
  for (int step = 0; step <= steps; ++step) {  // step 0 warms up
    const auto start = std::chrono::steady_clock::now();
    auto r = model->ForwardBackward(tokens.data(), targets.data(), batch, seq);
    const auto end = std::chrono::steady_clock::now();
    if (!r.ok()) {
      std::fprintf(stderr, "llama_step: %s\n", r.status().ToString().c_str());
      return 1;
    }
    loss = *r;
    if (step > 0) seconds.push_back(std::chrono::duration<double>(end - start).count());
  }
  std::sort(seconds.begin(), seconds.end());
  const double ours = seconds[seconds.size() / 2];
  std::printf("estuary: %zu parameters, batch %d x %d tokens, %d thread(s): median step %.1f ms (loss %.4f)\n",
              model->parameters().size(), batch, seq, threads, ours * 1e3, loss);

  // torch.set_num_threads bounds torch's own pool, not the OpenBLAS its GEMMs
  // call: without the variable, OpenBLAS runs PyTorch's GEMMs on every core.
  const std::string command = fmt::format(
      "OPENBLAS_NUM_THREADS={} OMP_NUM_THREADS={} {} {}/bench/torch_llama_step.py --vocab {} --hidden {} --intermediate {} --layers {} --heads {} "
      "--kv-heads {} --seq {} --batch {} --steps {} --threads {}",
      threads, threads, python, ESTUARY_SOURCE_DIR, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads,
      c.num_kv_heads, seq, batch, steps, threads);
  FILE* pipe = popen(command.c_str(), "r");
  double theirs = 0;
  if (!pipe || std::fscanf(pipe, "%lf", &theirs) != 1 || pclose(pipe) != 0 || theirs <= 0) {
    std::fprintf(stderr, "llama_step: the PyTorch run failed: %s\n", command.c_str());
    return 1;
  }
  std::printf("pytorch: median step %.1f ms\n", theirs * 1e3);
  std::printf("ratio (pytorch / estuary): %.2f\n", theirs / ours);
  return 0;
}
