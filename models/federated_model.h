// A federation's model by name: its initial global weights and how the server
// scores a global model on held-out data. The server and the simulator both
// start here, so both build the same model from (name, seed).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "models/lm_sequences.h"
#include "models/model.h"
#include "models/tensor.h"

namespace estuary::models {

struct InitialWeights {
  Manifest manifest;
  std::vector<float> values;
};

// "mlp", "cnn" or a language-model preset (language_model.h), initialised
// from `seed`.
Result<InitialWeights> InitialModel(std::string_view name, uint64_t seed);

struct EvaluatorOptions {
  int threads = 2;            // classifiers: replicas evaluating slices in parallel
  int seq_len = 128;          // language models: tokens per scored window
  uint64_t max_windows = 256; // language models: windows scored, spread over the held-out text
  uint64_t seed = 0;          // language models: the corpus split (text_corpus.h), as the clients use it
};

// Scores global weights on held-out data. Not thread-safe: one caller at a time.
class Evaluator {
 public:
  virtual ~Evaluator() = default;
  virtual Result<EvalResult> Evaluate(std::span<const float> global) = 0;
};

// Classifiers read the test split of an IDX directory; language models the
// held-out documents of every topic of a fortunes directory (the split the
// clients train around, from the same seed). Errors name the directory.
Result<std::unique_ptr<Evaluator>> MakeEvaluator(std::string_view model, const std::filesystem::path& data,
                                                 const EvaluatorOptions& options);

// A language model scored on held-out instruction rows (the response
// targets only, EvaluateLanguageModelRows), at most max_rows of them (0: all).
Result<std::unique_ptr<Evaluator>> MakeRowsEvaluator(std::string_view model, TokenRows rows, uint64_t max_rows);

}  // namespace estuary::models
