#include "models/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace estuary::models {

Status SamplingOptions::Validate() const {
  if (!std::isfinite(temperature) || temperature < 0) {
    return InvalidArgument("sampling: temperature {} must be finite and >= 0 (0 is greedy)", temperature);
  }
  if (top_k < 0) return InvalidArgument("sampling: top_k {} must be >= 0 (0 turns it off)", top_k);
  if (!(top_p > 0 && top_p <= 1)) return InvalidArgument("sampling: top_p {} must be in (0, 1]", top_p);
  return Status::Ok();
}

int32_t Argmax(std::span<const float> logits) {
  return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

double LogSoftmaxAt(std::span<const float> logits, int32_t token) {
  const double max = logits[Argmax(logits)];
  double sum = 0;
  for (float z : logits) sum += std::exp(double(z) - max);
  return double(logits[token]) - max - std::log(sum);
}

std::vector<double> SamplingDistribution(std::span<const float> logits, const SamplingOptions& options) {
  const size_t vocab = logits.size();
  std::vector<double> probs(vocab);
  for (size_t i = 0; i < vocab; ++i) probs[i] = double(logits[i]) / options.temperature;
  const double max = *std::max_element(probs.begin(), probs.end());
  // Top-k keeps every logit at least the k-th largest, as the warper's
  // `scores < topk(scores, k)[-1]` does: ties at the boundary all stay.
  double threshold = -INFINITY;
  if (options.top_k > 0 && size_t(options.top_k) < vocab) {
    std::vector<double> sorted = probs;
    std::nth_element(sorted.begin(), sorted.begin() + (options.top_k - 1), sorted.end(), std::greater<>());
    threshold = sorted[options.top_k - 1];
  }
  double sum = 0;
  for (double& p : probs) {
    p = p >= threshold ? std::exp(p - max) : 0.0;
    sum += p;
  }
  for (double& p : probs) p /= sum;
  if (options.top_p < 1) {
    std::vector<int32_t> kept;
    for (size_t i = 0; i < vocab; ++i) {
      if (probs[i] > 0) kept.push_back(int32_t(i));
    }
    // Least likely first (the higher id first among equals), as the warper's
    // ascending sort; the last, the most likely, is never removed.
    std::sort(kept.begin(), kept.end(), [&](int32_t a, int32_t b) {
      return probs[a] != probs[b] ? probs[a] < probs[b] : a > b;
    });
    double cumulative = 0;
    sum = 0;
    for (size_t r = 0; r < kept.size(); ++r) {
      cumulative += probs[kept[r]];
      if (cumulative <= 1 - options.top_p && r + 1 < kept.size()) {
        probs[kept[r]] = 0;
      } else {
        sum += probs[kept[r]];
      }
    }
    for (double& p : probs) p /= sum;
  }
  return probs;
}

int32_t TokenSampler::Next(std::span<const float> logits) {
  if (options_.temperature == 0) return Argmax(logits);
  const std::vector<double> probs = SamplingDistribution(logits, options_);
  // 53 random bits: a double uniform in [0, 1), the same on every machine.
  const double target = double(rng_() >> 11) * 0x1.0p-53;
  double cumulative = 0;
  int32_t last_kept = 0;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] == 0) continue;
    cumulative += probs[i];
    last_kept = int32_t(i);
    if (target < cumulative) return last_kept;
  }
  return last_kept;  // rounding left the cumulative sum just below target
}

}  // namespace estuary::models
