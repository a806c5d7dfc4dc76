// Hugging Face's on-disk formats: the decoder's model directory
// (models/llama.h: config.json and model.safetensors) and PEFT's adapter
// directory (models/lora.h: adapter_config.json and adapter_model.safetensors).
// Both are a safetensors file beside a JSON config; what the two share is
// written once here.
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string_view>

#include "models/checkpoint.h"
#include "models/llama.h"
#include "models/lora.h"

namespace estuary::models {

namespace fs = std::filesystem;

namespace {

// A directory of two files, each written atomically: the tensors as
// safetensors, with the metadata format "pt" that transformers and PEFT
// require, and the config beside them. The directory is created if needed.
Status SaveTensorsAndConfig(const fs::path& dir, std::string_view tensors_file, const Manifest& manifest,
                            std::span<const float> values, std::string_view config_file,
                            const nlohmann::ordered_json& config) {
  std::error_code error;
  fs::create_directories(dir, error);
  if (error) return IoError("{}: cannot create the directory: {}", dir.string(), error.message());
  ESTUARY_RETURN_IF_ERROR(SaveCheckpoint(dir / tensors_file, manifest, values, {{"format", "pt"}}));
  return WriteFileAtomically(dir / config_file, config.dump(2) + "\n");
}

// A config file's JSON object; errors name the file (and the key).
struct JsonConfig {
  fs::path path;
  nlohmann::json json;
  // PEFT writes null for a setting left at its default; for transformers'
  // config.json a null is a value like any other.
  bool null_is_absent = false;

  static Result<JsonConfig> Read(const fs::path& path, bool null_is_absent) {
    std::ifstream in(path);
    if (!in) return NotFound("{}: cannot open: {}", path.string(), std::strerror(errno));
    JsonConfig config{path, nlohmann::json::parse(in, nullptr, false), null_is_absent};
    if (config.json.is_discarded() || !config.json.is_object()) {
      return InvalidArgument("{}: not a JSON object", path.string());
    }
    return config;
  }

  // A key that, when present, must hold the one value this implementation supports.
  Status Only(const char* key, const nlohmann::json& supported) const {
    if (json.contains(key) && !(null_is_absent && json[key].is_null()) && json[key] != supported) {
      return InvalidArgument("{}: '{}' is {}; only {} is supported", path.string(), key, json[key].dump(),
                             supported.dump());
    }
    return Status::Ok();
  }
};

// Copies the tensors of `want` from `checkpoint` (read from `file`) into
// `values`, laid out as `want`, once every one is there with its shape and
// the checkpoint holds nothing else but what `ignored` accepts (may be null).
// On error nothing is copied; the message names the file and the tensor,
// `shape_source` what gave the expected shape and `expected` what the
// unexpected tensors are not.
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

}  // namespace

// ---------------------------------------------------- Hugging Face checkpoints

Status SaveHfCheckpoint(const fs::path& dir, const Llama& model) {
  const LlamaConfig& c = model.config();
  nlohmann::ordered_json json = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.num_heads},
      {"num_key_value_heads", c.num_kv_heads},
      {"head_dim", c.head_dim()},
      {"max_position_embeddings", c.max_seq_len},
      {"rms_norm_eps", c.rms_norm_eps},
      {"rope_theta", c.rope_theta},
      {"rope_scaling", nullptr},
      {"tie_word_embeddings", c.tie_embeddings},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"mlp_bias", false},
      {"initializer_range", 0.02},
      {"torch_dtype", "float32"},
  };
  return SaveTensorsAndConfig(dir, "model.safetensors", model.manifest(), model.parameters(), "config.json", json);
}

namespace {

// Reads config.json into a LlamaConfig, with Hugging Face LlamaConfig's
// defaults for absent keys; rejects what this implementation does not do.
Result<LlamaConfig> ReadHfConfig(const fs::path& path) {
  ESTUARY_ASSIGN_OR_RETURN(const JsonConfig config, JsonConfig::Read(path, /*null_is_absent=*/false));
  const nlohmann::json& json = config.json;

  auto integer = [&](const char* key, int fallback, int* out) -> Status {
    if (!json.contains(key) || json[key].is_null()) {
      *out = fallback;
      return Status::Ok();
    }
    const auto& v = json[key];
    if (!v.is_number_integer() || v.get<int64_t>() <= 0 || v.get<int64_t>() > INT_MAX) {
      return InvalidArgument("{}: '{}' is {}; expected a positive integer", path.string(), key, v.dump());
    }
    *out = v.get<int>();
    return Status::Ok();
  };
  auto number = [&](const char* key, double fallback, double* out) -> Status {
    if (!json.contains(key)) {
      *out = fallback;
      return Status::Ok();
    }
    if (!json[key].is_number()) {
      return InvalidArgument("{}: '{}' is {}; expected a number", path.string(), key, json[key].dump());
    }
    *out = json[key].get<double>();
    return Status::Ok();
  };
  ESTUARY_RETURN_IF_ERROR(config.Only("model_type", "llama"));
  ESTUARY_RETURN_IF_ERROR(config.Only("hidden_act", "silu"));
  ESTUARY_RETURN_IF_ERROR(config.Only("attention_bias", false));
  ESTUARY_RETURN_IF_ERROR(config.Only("mlp_bias", false));
  ESTUARY_RETURN_IF_ERROR(config.Only("rope_scaling", nullptr));
  if (json.contains("architectures")) {
    const auto& arch = json["architectures"];
    if (!arch.is_array() || std::find(arch.begin(), arch.end(), "LlamaForCausalLM") == arch.end()) {
      return InvalidArgument("{}: 'architectures' is {}; expected it to list LlamaForCausalLM", path.string(),
                             arch.dump());
    }
  }

  LlamaConfig c;
  ESTUARY_RETURN_IF_ERROR(integer("vocab_size", 32000, &c.vocab_size));
  ESTUARY_RETURN_IF_ERROR(integer("hidden_size", 4096, &c.hidden_size));
  ESTUARY_RETURN_IF_ERROR(integer("intermediate_size", 11008, &c.intermediate_size));
  ESTUARY_RETURN_IF_ERROR(integer("num_hidden_layers", 32, &c.num_layers));
  ESTUARY_RETURN_IF_ERROR(integer("num_attention_heads", 32, &c.num_heads));
  ESTUARY_RETURN_IF_ERROR(integer("num_key_value_heads", c.num_heads, &c.num_kv_heads));
  ESTUARY_RETURN_IF_ERROR(integer("max_position_embeddings", 2048, &c.max_seq_len));
  ESTUARY_RETURN_IF_ERROR(number("rms_norm_eps", 1e-6, &c.rms_norm_eps));
  ESTUARY_RETURN_IF_ERROR(number("rope_theta", 10000.0, &c.rope_theta));
  // transformers 5 writes RoPE's settings as one object in place of rope_theta and rope_scaling.
  if (json.contains("rope_parameters") && !json["rope_parameters"].is_null()) {
    const auto& rope = json["rope_parameters"];
    // (rope.value("rope_type", ...) would throw on a rope_type that is not a string.)
    if (!rope.is_object() || (rope.contains("rope_type") && rope["rope_type"] != "default")) {
      return InvalidArgument("{}: 'rope_parameters' is {}; only rope_type \"default\" is supported", path.string(),
                             rope.dump());
    }
    if (rope.contains("rope_theta")) {
      if (!rope["rope_theta"].is_number()) {
        return InvalidArgument("{}: 'rope_parameters.rope_theta' is {}; expected a number", path.string(),
                               rope["rope_theta"].dump());
      }
      c.rope_theta = rope["rope_theta"].get<double>();
    }
  }
  if (json.contains("tie_word_embeddings")) {
    if (!json["tie_word_embeddings"].is_boolean()) {
      return InvalidArgument("{}: 'tie_word_embeddings' is {}; expected true or false", path.string(),
                             json["tie_word_embeddings"].dump());
    }
    c.tie_embeddings = json["tie_word_embeddings"].get<bool>();
  }
  if (json.contains("head_dim") && !json["head_dim"].is_null() && json["head_dim"] != c.head_dim()) {
    return InvalidArgument("{}: 'head_dim' is {}, but hidden_size / num_attention_heads is {}; only that is supported",
                           path.string(), json["head_dim"].dump(), c.head_dim());
  }
  Status valid = c.Validate();
  if (!valid.ok()) return InvalidArgument("{}: {}", path.string(), valid.message());
  return c;
}

}  // namespace

Result<Llama> LoadHfCheckpoint(const fs::path& dir, int max_batch) {
  ESTUARY_ASSIGN_OR_RETURN(LlamaConfig config, ReadHfConfig(dir / "config.json"));
  const fs::path file = dir / "model.safetensors";
  ESTUARY_ASSIGN_OR_RETURN(Checkpoint checkpoint, LoadCheckpoint(file));  // checks every dtype is F32
  // Older transformers saved this non-trainable buffer; it is recomputed from rope_theta.
  auto recomputed = [](std::string_view name) { return name.ends_with("self_attn.rotary_emb.inv_freq"); };
  const std::string expected = fmt::format("not part of this config's LlamaForCausalLM{}",
                                           config.tie_embeddings ? ", whose embeddings are tied" : "");
  // The file must hold the config's model before the model is made: a
  // config.json alone (every absent key takes Hugging Face's 7B default)
  // must not make the loader map the parameters of a model it was not given.
  // A claim of far more tensors than the file holds is refused by count, as
  // the layout that names them costs memory in proportion to the layers a
  // config claims (a few bytes of JSON must not make millions of names); a
  // near miss goes on to name the first tensor missing.
  if (TensorCountOf(config) > 2 * int64_t(checkpoint.manifest.tensors.size()) + 16) {
    return InvalidArgument("{}: config.json implies {} tensors ({} layers), but the file holds {}", file.string(),
                           TensorCountOf(config), config.num_layers, checkpoint.manifest.tensors.size());
  }
  ESTUARY_RETURN_IF_ERROR(
      CheckTensors(file, checkpoint, LayoutOf(config).manifest, "config.json implies", expected, recomputed));
  ESTUARY_ASSIGN_OR_RETURN(Llama model, Llama::Create(config, max_batch));
  ESTUARY_RETURN_IF_ERROR(CopyCheckedTensors(file, checkpoint, model.manifest(), model.parameters(),
                                             "config.json implies", expected, recomputed));
  return model;
}

// ------------------------------------------------------------ PEFT files

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
