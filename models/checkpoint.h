// Checkpoints as safetensors files, written atomically.
//
// The file is the standard safetensors layout (8-byte little-endian header
// length, JSON header of name -> dtype/shape/data_offsets plus __metadata__,
// then the raw data), so torch and Hugging Face tools read it directly.
// SaveCheckpoint writes to a temporary file, fsyncs it, renames it over the
// target and fsyncs the directory: a crash leaves the old file or the new one.
//
// Federation checkpoints are F32 and LoadCheckpoint reads only F32 by
// default. With `widen_half` it also reads the BF16 and F16 tensors that
// published models are stored in, widened exactly to fp32 on load (every
// half value is a float), so the data is fp32 whatever the file held.
#pragma once

#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "base/atomic_file.h"
#include "base/status.h"
#include "models/tensor.h"

namespace estuary::models {

struct Checkpoint {
  Manifest manifest;                          // every tensor kF32: `data` is fp32 whatever the file stored
  std::map<std::string, DType> stored;        // each tensor's dtype in the file
  std::vector<float> data;                    // flat buffer, manifest layout
  std::map<std::string, std::string> metadata;  // string -> string, as safetensors allows
};

Status SaveCheckpoint(const std::filesystem::path& path, const Manifest& manifest,
                      std::span<const float> data,
                      const std::map<std::string, std::string>& metadata = {});
struct CheckpointReadOptions {
  bool widen_half = false;  // accept BF16 and F16 tensors, widened to fp32
};
Result<Checkpoint> LoadCheckpoint(const std::filesystem::path& path, const CheckpointReadOptions& options = {});

// The exact fp32 value of a bfloat16 (its bits are a float's top 16) and of
// an IEEE binary16 (subnormals, infinities and NaN kept, a NaN's payload too).
float Bf16BitsToFloat(uint16_t bits);
float F16BitsToFloat(uint16_t bits);

}  // namespace estuary::models
