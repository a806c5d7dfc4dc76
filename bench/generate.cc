// bench/generate: greedy generation with the KV cache (models/generate.h)
// against recomputing Llama::Forward over the whole sequence for every new
// token, the way a decoder without a cache generates; the same model, prompt
// and thread count, in one process. Prints the new tokens per second of each
// (prefill included), the ratio, and whether both chose the same tokens.
//   build/bench/generate [--preset llama-small] [--prompt 16] [--new-tokens 128] [--steps 3] [--threads 1]
#include <fmt/format.h>

#include <vector>

#include "bench/decoder.h"
#include "bench/harness.h"
#include "models/generate.h"
#include "models/language_model.h"

namespace {

using namespace estuary;

// The tokens that follow `prompt` with the cache: prefill, then one step a token.
Status CachedGreedy(const models::Llama& model, const std::vector<int32_t>& prompt, int new_tokens,
                    std::vector<int32_t>& out) {
  const int capacity = int(prompt.size()) + new_tokens - 1;
  ESTUARY_ASSIGN_OR_RETURN(models::KvCacheDecoder decoder, models::KvCacheDecoder::Create(model, capacity));
  std::vector<float> logits(model.config().vocab_size);
  out.clear();
  ESTUARY_RETURN_IF_ERROR(decoder.Append(prompt, logits));
  for (int i = 0; i < new_tokens; ++i) {
    if (i > 0) ESTUARY_RETURN_IF_ERROR(decoder.Append(std::span(&out.back(), 1), logits));
    out.push_back(models::Argmax(logits));
  }
  return Status::Ok();
}

// The same tokens from the full forward over the sequence so far, each step.
Status RecomputedGreedy(models::Llama& model, const std::vector<int32_t>& prompt, int new_tokens,
                        std::vector<int32_t>& out) {
  const int vocab = model.config().vocab_size;
  std::vector<int32_t> sequence = prompt;
  std::vector<float> logits(size_t(prompt.size() + new_tokens) * vocab);
  out.clear();
  for (int i = 0; i < new_tokens; ++i) {
    const int seq = int(sequence.size());
    ESTUARY_RETURN_IF_ERROR(model.Forward(sequence.data(), 1, seq, logits.data()));
    out.push_back(models::Argmax(std::span(logits).subspan(size_t(seq - 1) * vocab, vocab)));
    sequence.push_back(out.back());
  }
  return Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  bench::Bench bench("generate", "greedy generation: the KV cache against recomputing the full forward");
  std::string preset = "llama-small";
  int prompt_length = 16, new_tokens = 128, threads = 1;
  bench::Repetitions runs{.warmup = 1, .timed = 3};
  bench.app().add_option("--preset", preset);
  bench.app().add_option("--prompt", prompt_length, "prompt tokens")->check(bench::AtLeast(1));
  bench.app().add_option("--new-tokens", new_tokens, "tokens generated per run")->check(bench::AtLeast(1));
  bench.AddRepetitions(runs);
  bench.AddThreads(threads, "OpenBLAS threads");
  if (auto code = bench.Parse(argc, argv)) return *code;
  openblas_set_num_threads(threads);
  auto config = models::LlamaPreset(preset);
  if (!config.ok()) return bench.Fail(config.status());
  if (prompt_length + new_tokens - 1 > config->max_seq_len) {
    return bench.Fail(InvalidArgument("--prompt {} + --new-tokens {} exceed {}'s context of {}", prompt_length,
                                      new_tokens, preset, config->max_seq_len));
  }
  auto model = models::Llama::Create(*config, 1);
  if (!model.ok()) return bench.Fail(model.status());
  model->Initialize(1);
  const std::vector<int32_t> prompt = bench::RandomTokens(size_t(prompt_length), config->vocab_size, 7).tokens;

  // The two alternate, run by run, so that load from elsewhere on a shared
  // machine falls on both alike.
  std::vector<int32_t> cached_tokens, recomputed_tokens;
  bench::Samples cached, recomputed;
  for (int run = 0; run < runs.warmup + runs.timed; ++run) {
    bench::Stopwatch cached_clock;
    if (Status s = CachedGreedy(*model, prompt, new_tokens, cached_tokens); !s.ok()) return bench.Fail(s);
    const double cached_seconds = cached_clock.Seconds();
    bench::Stopwatch recomputed_clock;
    if (Status s = RecomputedGreedy(*model, prompt, new_tokens, recomputed_tokens); !s.ok()) return bench.Fail(s);
    if (run >= runs.warmup) {
      cached.Add(cached_seconds);
      recomputed.Add(recomputed_clock.Seconds());
    }
  }

  size_t agreeing = 0;
  while (agreeing < cached_tokens.size() && cached_tokens[agreeing] == recomputed_tokens[agreeing]) ++agreeing;
  fmt::print("{}: {} parameters, prompt {} tokens, {} new tokens (greedy), {} thread(s), median of {} runs\n", preset,
             model->parameters().size(), prompt_length, new_tokens, threads, runs.timed);
  fmt::print("KV cache:  {:8.1f} tokens/s  ({} per run)\n", new_tokens / cached.median(),
             bench::MedianAndRangeMs(cached));
  fmt::print("recompute: {:8.1f} tokens/s  ({} per run)\n", new_tokens / recomputed.median(),
             bench::MedianAndRangeMs(recomputed));
  fmt::print("same tokens: {} of {}\n", agreeing, new_tokens);
  bench::PrintRatio("KV cache / recompute, tokens/s", recomputed.median() / cached.median());
  return 0;
}
