// Checkpoints as safetensors files, written atomically.
//
// The file is the standard safetensors layout (8-byte little-endian header
// length, JSON header of name -> dtype/shape/data_offsets plus __metadata__,
// then the raw data), so torch and Hugging Face tools read it directly.
// SaveCheckpoint writes to a temporary file, fsyncs it, renames it over the
// target and fsyncs the directory: a crash leaves the old file or the new one.
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
  Manifest manifest;
  std::vector<float> data;                    // flat buffer, manifest layout
  std::map<std::string, std::string> metadata;  // string -> string, as safetensors allows
};

Status SaveCheckpoint(const std::filesystem::path& path, const Manifest& manifest,
                      std::span<const float> data,
                      const std::map<std::string, std::string>& metadata = {});
Result<Checkpoint> LoadCheckpoint(const std::filesystem::path& path);

}  // namespace estuary::models
