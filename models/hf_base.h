// HfBase: a Hugging Face Llama-family checkpoint directory as the frozen base
// of a LoRA federation, which every site holds itself and the server never
// sends.
//
// Its identity is a SHA-256 that the server computes from its copy and every
// site from its own:
//   SHA-256( "estuary-hf-base-v1\n"
//            || CanonicalShape(config)            (UTF-8 text, below)
//            || the fp32 weights, little-endian, in LayoutOf(config) order )
// The weights are the values as loaded (BF16 and F16 files widen exactly to
// fp32), so an unsharded and a sharded copy, or an F32 and a BF16 copy of
// the same bf16-representable values, have one identity; one weight that
// differs in one bit gives another. The file layout, dtype on disk and
// tokenizer files do not count.
//
// CanonicalShape is one "key=value\n" line per shape field of LlamaConfig in
// a fixed order, with config.json's key names (numbers as the shortest text
// that reads back to the same double). It travels in the task
// (v1::HfBaseModel.shape) so a site builds the same model and compares its
// own copy's shape with the server's, key by key.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/manifest.h"
#include "base/status.h"
#include "models/llama.h"

namespace estuary::models {

std::string CanonicalShape(const LlamaConfig& config);
// The config CanonicalShape wrote (max_seq_len = max_position_embeddings);
// errors name the line. Validated.
Result<LlamaConfig> ParseCanonicalShape(std::string_view text);
// The first key whose line differs, as "key: A vs B"; empty when equal.
std::string FirstShapeDifference(std::string_view mine, std::string_view theirs);

// The identity above, hex, of `weights` laid out as LayoutOf(config).
std::string HfBaseIdentity(const LlamaConfig& config, std::span<const float> weights);

struct HfBase {
  std::filesystem::path dir;
  LlamaConfig config;
  std::string shape;            // CanonicalShape(config)
  Manifest manifest;            // LayoutOf(config).manifest
  std::vector<float> weights;   // fp32, in manifest order
  std::string sha256;           // HfBaseIdentity
  // How a federation names it: the directory's name and the identity's
  // first 12 hex digits ("tiny-llama@3f2a9c1b0d4e"), so two bases never
  // share a name in the round log.
  std::string ModelName() const;
};

// Reads config.json and the weights (LoadHfCheckpoint's checks and errors,
// its memory check with `options`: a site that trains with recompute checks
// recompute's arena) and computes the identity. options.max_seq_len is
// ignored: the shape, and so the identity, keeps config.json's context.
Result<HfBase> LoadHfBase(const std::filesystem::path& dir, HfLoadOptions options = {});

// True when `path` is a model directory (holds config.json), as opposed to a
// preset's safetensors file.
bool IsHfModelDir(const std::filesystem::path& path);

}  // namespace estuary::models
