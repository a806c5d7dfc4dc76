// models/hf_common.h: what the Hugging Face and PEFT directories share.
#include "models/hf_common.h"

#include <fmt/ranges.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "base/atomic_file.h"
#include "models/llama.h"

namespace estuary::models::hf {

namespace fs = std::filesystem;

Status SaveTensorsAndConfig(const fs::path& dir, std::string_view tensors_file, const Manifest& manifest,
                            std::span<const float> values, std::string_view config_file,
                            const nlohmann::ordered_json& config) {
  std::error_code error;
  fs::create_directories(dir, error);
  if (error) return IoError("{}: cannot create the directory: {}", dir.string(), error.message());
  ESTUARY_RETURN_IF_ERROR(SaveCheckpoint(dir / tensors_file, manifest, values, {{"format", "pt"}}));
  return WriteFileAtomically(dir / config_file, config.dump(2) + "\n");
}

Result<JsonConfig> JsonConfig::Read(const fs::path& path, bool null_is_absent) {
  std::ifstream in(path);
  if (!in) return NotFound("{}: cannot open: {}", path.string(), std::strerror(errno));
  JsonConfig config{path, nlohmann::json::parse(in, nullptr, false), null_is_absent};
  if (config.json.is_discarded() || !config.json.is_object()) {
    return InvalidArgument("{}: not a JSON object", path.string());
  }
  return config;
}

Status JsonConfig::Only(const char* key, const nlohmann::json& supported) const {
  if (json.contains(key) && !(null_is_absent && json[key].is_null()) && json[key] != supported) {
    return InvalidArgument("{}: '{}' is {}; only {} is supported", path.string(), key, json[key].dump(),
                           supported.dump());
  }
  return Status::Ok();
}

Status CheckTensors(const fs::path& file, const Checkpoint& checkpoint, const Manifest& want_manifest,
                    std::string_view shape_source, std::string_view expected, bool (*ignored)(std::string_view name)) {
  for (const TensorSpec& want : want_manifest.tensors) {
    const TensorSpec* got = checkpoint.manifest.Find(want.name);
    if (!got) return InvalidArgument("{}: tensor '{}' is missing", file.string(), want.name);
    if (got->shape != want.shape) {
      return InvalidArgument("{}: tensor '{}' has shape [{}], but {} [{}]", file.string(), want.name,
                             fmt::join(got->shape, ", "), shape_source, fmt::join(want.shape, ", "));
    }
  }
  for (const TensorSpec& got : checkpoint.manifest.tensors) {
    if (want_manifest.Find(got.name) || (ignored && ignored(got.name))) continue;
    return InvalidArgument("{}: unexpected tensor '{}' ({})", file.string(), got.name, expected);
  }
  return Status::Ok();
}

Status CopyCheckedTensors(const fs::path& file, const Checkpoint& checkpoint, const Manifest& want_manifest,
                          std::span<float> values, std::string_view shape_source, std::string_view expected,
                          bool (*ignored)(std::string_view name)) {
  ESTUARY_RETURN_IF_ERROR(CheckTensors(file, checkpoint, want_manifest, shape_source, expected, ignored));
  for (const TensorSpec& want : want_manifest.tensors) {
    const TensorSpec* got = checkpoint.manifest.Find(want.name);
    std::memcpy(values.data() + want.offset, checkpoint.data.data() + got->offset, sizeof(float) * want.numel());
  }
  return Status::Ok();
}

nlohmann::ordered_json RopeScalingJson(const RopeScaling& r) {
  switch (r.kind) {
    case RopeScaling::Kind::kLinear:
      return {{"rope_type", "linear"}, {"factor", r.factor}};
    case RopeScaling::Kind::kLlama3:
      return {{"rope_type", "llama3"},
              {"factor", r.factor},
              {"low_freq_factor", r.low_freq_factor},
              {"high_freq_factor", r.high_freq_factor},
              {"original_max_position_embeddings", r.original_max_position_embeddings}};
    case RopeScaling::Kind::kNone:
      break;
  }
  return nullptr;
}

}  // namespace estuary::models::hf
