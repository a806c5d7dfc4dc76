#include "models/language_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <map>
#include <mutex>

#include "models/hf_base.h"
#include "models/transformer_ops.h"

namespace estuary::models {

namespace {

// Adds one position's cross-entropy (in double) to *loss, and 1 to *correct
// when the argmax is the target.
void Score(const float* row, int vocab, int32_t target, double* loss, uint64_t* correct) {
  const float max = *std::max_element(row, row + vocab);
  double sum = 0;
  for (int v = 0; v < vocab; ++v) sum += std::exp(double(row[v]) - max);
  *loss += std::log(sum) + max - row[target];
  *correct += std::max_element(row, row + vocab) - row == target;
}

struct HfModels {
  std::mutex mutex;
  std::map<std::string, LlamaConfig, std::less<>> configs;
};

HfModels& Registered() {
  static HfModels models;
  return models;
}

}  // namespace

Status RegisterHfModel(const std::string& name, const LlamaConfig& config) {
  HfModels& models = Registered();
  std::lock_guard lock(models.mutex);
  auto [it, inserted] = models.configs.try_emplace(name, config);
  if (inserted) return Status::Ok();
  const std::string difference = FirstShapeDifference(CanonicalShape(it->second), CanonicalShape(config));
  if (difference.empty()) return Status::Ok();
  return FailedPrecondition("model '{}' is already this process's with another shape ({})", name, difference);
}

bool IsLanguageModel(std::string_view name) {
  if (name.starts_with("llama")) return true;
  HfModels& models = Registered();
  std::lock_guard lock(models.mutex);
  return models.configs.find(name) != models.configs.end();
}

Result<LlamaConfig> LlamaPreset(std::string_view name) {
  {
    HfModels& models = Registered();
    std::lock_guard lock(models.mutex);
    if (auto it = models.configs.find(name); it != models.configs.end()) return it->second;
  }
  LlamaConfig c;
  c.vocab_size = 256;
  if (name == "llama-tiny") {
    c.hidden_size = 128, c.intermediate_size = 352, c.num_layers = 4, c.num_heads = 4, c.num_kv_heads = 2;
    c.max_seq_len = 128;
  } else if (name == "llama-small") {
    c.hidden_size = 384, c.intermediate_size = 1024, c.num_layers = 6, c.num_heads = 6, c.num_kv_heads = 2;
    c.max_seq_len = 256;
  } else if (name == "llama-124m") {
    c.vocab_size = 50304, c.hidden_size = 768, c.intermediate_size = 2048, c.num_layers = 12, c.num_heads = 12;
    c.num_kv_heads = 12, c.max_seq_len = 1024, c.tie_embeddings = true;
  } else {
    return InvalidArgument("model: unknown language model '{}' (known: llama-tiny, llama-small, llama-124m)", name);
  }
  ESTUARY_RETURN_IF_ERROR(c.Validate());
  return c;
}

Result<EvalResult> EvaluateLanguageModel(Llama& model, std::span<const float> params, std::span<const int32_t> tokens,
                                         int seq, uint64_t max_windows) {
  if (params.size() != model.parameters().size()) {
    return InvalidArgument("eval: {} parameters for a model of {}", params.size(), model.parameters().size());
  }
  if (seq <= 0 || seq > model.config().max_seq_len) {
    return InvalidArgument("eval: seq {} not in [1, {}]", seq, model.config().max_seq_len);
  }
  const uint64_t available = tokens.size() > 0 ? (tokens.size() - 1) / uint64_t(seq) : 0;
  if (available == 0) return InvalidArgument("eval: {} tokens hold no window of {} + 1", tokens.size(), seq);
  const uint64_t windows = std::min<uint64_t>(available, std::max<uint64_t>(max_windows, 1));
  std::memcpy(model.parameters().data(), params.data(), params.size_bytes());

  const int vocab = model.config().vocab_size;
  const int batch = model.max_batch();
  std::vector<int32_t> inputs(size_t(batch) * seq);
  std::vector<float> logits(size_t(batch) * seq * vocab);
  std::vector<const int32_t*> targets(batch);
  double loss = 0;
  uint64_t correct = 0, scored = 0;
  for (uint64_t first = 0; first < windows; first += batch) {
    const int n = int(std::min<uint64_t>(batch, windows - first));
    for (int b = 0; b < n; ++b) {
      // Windows spread evenly: window w starts at floor(w * available / windows) * seq.
      const uint64_t start = (first + b) * available / windows * uint64_t(seq);
      std::copy_n(tokens.data() + start, seq, inputs.data() + size_t(b) * seq);
      targets[b] = tokens.data() + start + 1;
    }
    ESTUARY_RETURN_IF_ERROR(model.Forward(inputs.data(), n, seq, logits.data()));
    for (int b = 0; b < n; ++b) {
      for (int t = 0; t < seq; ++t) {
        const float* row = logits.data() + (size_t(b) * seq + t) * vocab;
        const int32_t target = targets[b][t];
        if (target < 0 || target >= vocab) return InvalidArgument("eval: target token {} not in [0, {})", target, vocab);
        Score(row, vocab, target, &loss, &correct);
        ++scored;
      }
    }
  }
  EvalResult result;
  result.loss = loss / double(scored);
  result.accuracy = double(correct) / double(scored);
  result.examples = scored;
  return result;
}

Result<EvalResult> EvaluateLanguageModelRows(Llama& model, std::span<const float> params, const TokenRows& rows,
                                             uint64_t max_rows) {
  if (params.size() != model.parameters().size()) {
    return InvalidArgument("eval: {} parameters for a model of {}", params.size(), model.parameters().size());
  }
  const int seq = rows.seq_len;
  if (seq <= 0 || seq > model.config().max_seq_len) {
    return InvalidArgument("eval: seq {} not in [1, {}]", seq, model.config().max_seq_len);
  }
  const uint64_t available = uint64_t(rows.rows());
  if (available == 0) return InvalidArgument("eval: no held-out rows");
  const uint64_t count = max_rows == 0 ? available : std::min<uint64_t>(available, max_rows);
  std::memcpy(model.parameters().data(), params.data(), params.size_bytes());

  const int vocab = model.config().vocab_size;
  const int batch = model.max_batch();
  std::vector<int32_t> inputs(size_t(batch) * seq);
  std::vector<float> logits(size_t(batch) * seq * vocab);
  double loss = 0;
  uint64_t correct = 0, scored = 0;
  for (uint64_t first = 0; first < count; first += batch) {
    const int n = int(std::min<uint64_t>(batch, count - first));
    // Rows spread evenly over the set: row i of count is floor(i * available / count).
    auto row_of = [&](uint64_t i) { return i * available / count; };
    for (int b = 0; b < n; ++b) {
      std::copy_n(rows.tokens.data() + row_of(first + b) * seq, seq, inputs.data() + size_t(b) * seq);
    }
    ESTUARY_RETURN_IF_ERROR(model.Forward(inputs.data(), n, seq, logits.data()));
    for (int b = 0; b < n; ++b) {
      const int32_t* targets = rows.targets.data() + row_of(first + b) * seq;
      for (int t = 0; t < seq; ++t) {
        const int32_t target = targets[t];
        if (target == kIgnoredTarget) continue;
        if (target < 0 || target >= vocab) return InvalidArgument("eval: target token {} not in [0, {})", target, vocab);
        const float* row = logits.data() + (size_t(b) * seq + t) * vocab;
        Score(row, vocab, target, &loss, &correct);
        ++scored;
      }
    }
  }
  if (scored == 0) return InvalidArgument("eval: the held-out rows score no target");
  return EvalResult{.loss = loss / double(scored), .accuracy = double(correct) / double(scored), .examples = scored};
}

}  // namespace estuary::models
