// What a Hugging Face model directory (models/hf_files.cc: config.json and
// model.safetensors) and a PEFT adapter directory (models/peft_files.cc:
// adapter_config.json and adapter_model.safetensors) share: a safetensors
// file beside a JSON config. Internal to those two readers and writers, and
// to estuary-lm, which prints a config as config.json holds it.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <span>
#include <string_view>

#include "base/status.h"
#include "models/checkpoint.h"

namespace estuary::models {
struct RopeScaling;
}

namespace estuary::models::hf {

// A directory of two files, each written atomically: the tensors as
// safetensors, with the metadata format "pt" that transformers and PEFT
// require, and the config beside them. The directory is created if needed.
Status SaveTensorsAndConfig(const std::filesystem::path& dir, std::string_view tensors_file, const Manifest& manifest,
                            std::span<const float> values, std::string_view config_file,
                            const nlohmann::ordered_json& config);

// A config file's JSON object; errors name the file (and the key).
struct JsonConfig {
  std::filesystem::path path;
  nlohmann::json json;
  // PEFT writes null for a setting left at its default; for transformers'
  // config.json a null is a value like any other.
  bool null_is_absent = false;

  static Result<JsonConfig> Read(const std::filesystem::path& path, bool null_is_absent);
  // A key that, when present, must hold the one value this implementation supports.
  Status Only(const char* key, const nlohmann::json& supported) const;
};

// Checks that `checkpoint` (read from `file`) holds every tensor of
// `want_manifest` with its shape, and nothing else but what `ignored` accepts
// (may be null). The message names the file and the tensor, `shape_source`
// what gave the expected shape and `expected` what the unexpected tensors are not.
Status CheckTensors(const std::filesystem::path& file, const Checkpoint& checkpoint, const Manifest& want_manifest,
                    std::string_view shape_source, std::string_view expected, bool (*ignored)(std::string_view name));

// CheckTensors, then copies the tensors into `values`, laid out as
// `want_manifest`; on error nothing is copied.
Status CopyCheckedTensors(const std::filesystem::path& file, const Checkpoint& checkpoint,
                          const Manifest& want_manifest, std::span<float> values, std::string_view shape_source,
                          std::string_view expected, bool (*ignored)(std::string_view name));

// config.json's rope_scaling for `r`: null, or the linear or llama3 object
// with the keys transformers reads.
nlohmann::ordered_json RopeScalingJson(const RopeScaling& r);

}  // namespace estuary::models::hf
