// The language models by name, and their evaluation on held-out text.
//
// A federation names its model ("mlp", "cnn", "llama-tiny", ...); the names
// starting with "llama" are decoders over byte tokens (text_corpus.h) whose
// sizes are fixed here, so every site builds the same manifest from the name.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "base/status.h"
#include "models/llama.h"
#include "models/lm_sequences.h"
#include "models/model.h"

namespace estuary::models {

// A preset (below) or a name registered with RegisterHfModel.
bool IsLanguageModel(std::string_view name);

// A federation on a Hugging Face base (models/hf_base.h) names its model
// HfBase::ModelName() and carries the shape in its task; whoever builds that
// federation or maps that task registers the name here, so everything that
// builds a decoder by name (evaluators, site trainers, export) builds that
// shape. Registering a name again with the same shape is a no-op; with
// another shape it fails, naming the first key that differs. Thread-safe.
Status RegisterHfModel(const std::string& name, const LlamaConfig& config);

// "llama-tiny"  (d 128, 4 layers, 4 heads / 2 kv, MLP 352, context 128: a CPU federation),
// "llama-small" (d 384, 6 layers, 6 heads / 2 kv, MLP 1024, context 256),
// "llama-124m"  (d 768, 12 layers, 12 heads, MLP 2048, context 1024, GPT-2's
//                50,304-token vocabulary, tied: the ~124M benchmark model).
// The first two use the byte vocabulary (256). A name registered with
// RegisterHfModel gives its config. Unknown names list the known ones.
Result<LlamaConfig> LlamaPreset(std::string_view name);

// Mean next-token cross-entropy and accuracy of `params` loaded into `model`
// over non-overlapping windows of `seq` tokens of `tokens` (each window
// predicts its next `seq` tokens), at most `max_windows` of them spread evenly
// over the stream. examples counts the tokens scored. Fails if the stream is
// shorter than one window or holds a token outside the vocabulary.
Result<EvalResult> EvaluateLanguageModel(Llama& model, std::span<const float> params, std::span<const int32_t> tokens,
                                         int seq, uint64_t max_windows);

// The same over instruction rows (lm_sequences.h): the mean loss and
// accuracy over the targets that are not -100 (the responses), of at most
// max_rows rows (0: all) spread evenly. examples counts the targets scored.
// Fails on rows that score nothing.
Result<EvalResult> EvaluateLanguageModelRows(Llama& model, std::span<const float> params, const TokenRows& rows,
                                             uint64_t max_rows);

}  // namespace estuary::models
