// PEFT's adapter directory (models/lora.h: adapter_config.json and
// adapter_model.safetensors), which PeftModel.from_pretrained loads.
#include <fmt/ranges.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <nlohmann/json.hpp>

#include "models/checkpoint.h"
#include "models/hf_common.h"
#include "models/llama.h"
#include "models/lora.h"

namespace estuary::models {

namespace fs = std::filesystem;
using hf::CopyCheckedTensors;
using hf::JsonConfig;
using hf::SaveTensorsAndConfig;

Status SaveLoraAdapter(const fs::path& dir, const LoraLlama& model) {
  const LoraConfig& c = model.lora_config();
  // The keys PEFT's LoraConfig writes, with the values this implementation
  // means (the rest take PEFT's defaults when read).
  nlohmann::ordered_json json = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", c.base_model_name_or_path},
      {"r", c.rank},
      {"lora_alpha", c.alpha},
      {"lora_dropout", c.dropout},
      {"target_modules", c.target_modules},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"use_rslora", false},
      {"use_dora", false},
      {"init_lora_weights", true},
      {"inference_mode", true},
      {"modules_to_save", nullptr},
      {"layers_to_transform", nullptr},
      {"layers_pattern", nullptr},
      {"rank_pattern", nlohmann::json::object()},
      {"alpha_pattern", nlohmann::json::object()},
      {"revision", nullptr},
  };
  return SaveTensorsAndConfig(dir, "adapter_model.safetensors", model.manifest(), model.parameters(),
                              "adapter_config.json", json);
}

Result<LoraConfig> ReadLoraConfig(const fs::path& dir) {
  const fs::path path = dir / "adapter_config.json";
  ESTUARY_ASSIGN_OR_RETURN(const JsonConfig config, JsonConfig::Read(path, /*null_is_absent=*/true));
  const nlohmann::json& json = config.json;
  ESTUARY_RETURN_IF_ERROR(config.Only("peft_type", "LORA"));
  ESTUARY_RETURN_IF_ERROR(config.Only("bias", "none"));
  ESTUARY_RETURN_IF_ERROR(config.Only("fan_in_fan_out", false));
  ESTUARY_RETURN_IF_ERROR(config.Only("use_rslora", false));
  ESTUARY_RETURN_IF_ERROR(config.Only("use_dora", false));
  ESTUARY_RETURN_IF_ERROR(config.Only("rank_pattern", nlohmann::json::object()));
  ESTUARY_RETURN_IF_ERROR(config.Only("alpha_pattern", nlohmann::json::object()));
  ESTUARY_RETURN_IF_ERROR(config.Only("layers_to_transform", nullptr));
  ESTUARY_RETURN_IF_ERROR(config.Only("modules_to_save", nullptr));
  auto need = [&](const char* key) -> Status {
    if (!json.contains(key)) return InvalidArgument("{}: '{}' is missing", path.string(), key);
    return Status::Ok();
  };
  LoraConfig c;
  ESTUARY_RETURN_IF_ERROR(need("r"));
  if (!json["r"].is_number_integer() || json["r"].get<int64_t>() <= 0 || json["r"].get<int64_t>() > INT_MAX) {
    return InvalidArgument("{}: 'r' is {}; expected a positive integer", path.string(), json["r"].dump());
  }
  c.rank = json["r"].get<int>();
  // A number that a float holds (a double past FLT_MAX made float is undefined).
  auto real = [&](const char* key, float* out) -> Status {
    const auto& v = json[key];
    if (!v.is_number() || !(std::fabs(v.get<double>()) <= FLT_MAX)) {
      return InvalidArgument("{}: '{}' is {}; expected a number", path.string(), key, v.dump());
    }
    *out = static_cast<float>(v.get<double>());
    return Status::Ok();
  };
  ESTUARY_RETURN_IF_ERROR(need("lora_alpha"));
  ESTUARY_RETURN_IF_ERROR(real("lora_alpha", &c.alpha));
  if (json.contains("lora_dropout")) ESTUARY_RETURN_IF_ERROR(real("lora_dropout", &c.dropout));
  ESTUARY_RETURN_IF_ERROR(need("target_modules"));
  const auto& targets = json["target_modules"];
  const auto is_string = [](const nlohmann::json& t) { return t.is_string(); };
  if (!targets.is_array() || !std::all_of(targets.begin(), targets.end(), is_string)) {
    return InvalidArgument("{}: 'target_modules' is {}; only a list of module names is supported", path.string(),
                           targets.dump());
  }
  c.target_modules = targets.get<std::vector<std::string>>();
  if (json.contains("base_model_name_or_path") && json["base_model_name_or_path"].is_string()) {
    c.base_model_name_or_path = json["base_model_name_or_path"].get<std::string>();
  }
  Status valid = c.Validate();
  if (!valid.ok()) return InvalidArgument("{}: {}", path.string(), valid.message());
  return c;
}

Status LoadLoraAdapter(const fs::path& dir, LoraLlama& model) {
  ESTUARY_ASSIGN_OR_RETURN(LoraConfig config, ReadLoraConfig(dir));
  const fs::path config_path = dir / "adapter_config.json";
  const LoraConfig& want_config = model.lora_config();
  if (config.rank != want_config.rank) {
    return InvalidArgument("{}: 'r' is {}, but the model's adapters have rank {}", config_path.string(), config.rank,
                           want_config.rank);
  }
  if (config.alpha != want_config.alpha) {
    return InvalidArgument("{}: 'lora_alpha' is {}, but the model's is {}", config_path.string(), config.alpha,
                           want_config.alpha);
  }
  for (int i = 0; i < kLoraModules; ++i) {
    const LoraModule m = LoraModule(i);
    if (config.Targets(m) != want_config.Targets(m)) {
      return InvalidArgument("{}: 'target_modules' is [{}], but the model adapts [{}] ({} differs)",
                             config_path.string(), fmt::join(config.target_modules, ", "),
                             fmt::join(want_config.target_modules, ", "), LoraModuleName(m));
    }
  }
  const fs::path file = dir / "adapter_model.safetensors";
  ESTUARY_ASSIGN_OR_RETURN(Checkpoint checkpoint, LoadCheckpoint(file));  // checks every dtype is F32
  // Everything is checked before anything is copied: a bad file leaves the model as it was.
  return CopyCheckedTensors(file, checkpoint, model.manifest(), model.parameters(),
                            "adapter_config.json and the base imply", "not an adapter of this model", nullptr);
}

Status SaveMergedHfCheckpoint(const fs::path& dir, const LoraLlama& model) {
  ESTUARY_ASSIGN_OR_RETURN(Llama merged, model.Merged(1));
  return SaveHfCheckpoint(dir, merged);
}

}  // namespace estuary::models
