// Choosing the next token from a row of logits, as Hugging Face's generate
// does with do_sample: temperature, then top-k, then top-p (its
// TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper, in that
// order), then a draw from the softmax of what is left.
//
//   SamplingOptions options{.temperature = 0.8, .top_k = 50, .top_p = 0.95, .seed = 7};
//   ESTUARY_RETURN_IF_ERROR(options.Validate());
//   TokenSampler sampler(options);
//   int32_t next = sampler.Next(logits);
//
// Temperature 0 is greedy decoding: the argmax (the lowest id among equal
// maxima, as torch.argmax), with top-k and top-p ignored. Draws come from a
// std::mt19937_64 seeded with `seed` and turned into probabilities by
// explicit arithmetic, so the same seed gives the same tokens on any machine.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "base/status.h"

namespace estuary::models {

struct SamplingOptions {
  double temperature = 1.0;  // 0: greedy
  int top_k = 0;             // keep the k largest logits (ties at the k-th all kept); 0: off
  double top_p = 1.0;        // keep the smallest set whose probability reaches top_p; 1: off
  uint64_t seed = 0;

  // temperature finite and >= 0, top_k >= 0, top_p in (0, 1]; the message
  // names the field and its value.
  Status Validate() const;
};

// The distribution a sampling step draws from: softmax(logits / temperature)
// over the tokens top-k and top-p keep, renormalised, in double; the tokens
// filtered out get 0. Top-p works as Hugging Face's: sorted by probability,
// a token is removed while the cumulative probability of it and every less
// likely token is at most 1 - top_p, and the most likely token always stays.
// `options` must be valid and its temperature positive; logits non-empty.
std::vector<double> SamplingDistribution(std::span<const float> logits, const SamplingOptions& options);

// The first index of the largest logit.
int32_t Argmax(std::span<const float> logits);

// log softmax(logits)[token], in double.
double LogSoftmaxAt(std::span<const float> logits, int32_t token);

class TokenSampler {
 public:
  // `options` must be valid (SamplingOptions::Validate).
  explicit TokenSampler(const SamplingOptions& options) : options_(options), rng_(options.seed) {}

  // The next token for a row of logits (one per vocabulary entry): the
  // argmax when greedy, otherwise one draw from SamplingDistribution.
  int32_t Next(std::span<const float> logits);

 private:
  SamplingOptions options_;
  std::mt19937_64 rng_;
};

}  // namespace estuary::models
