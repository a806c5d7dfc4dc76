// Hugging Face's model directory for the decoder (models/llama.h: config.json
// and model.safetensors, or its shards). PEFT's adapter directory is
// models/peft_files.cc; what the two share is models/hf_common.h.
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string_view>

#include "models/checkpoint.h"
#include "models/hf_common.h"
#include "models/llama.h"
#include "models/lora.h"

namespace estuary::models {

namespace fs = std::filesystem;
using hf::CheckTensors;
using hf::CopyCheckedTensors;
using hf::JsonConfig;
using hf::RopeScalingJson;
using hf::SaveTensorsAndConfig;

// ---------------------------------------------------- Hugging Face checkpoints

namespace {

// The architectures this loader reads: the same decoder, named three ways.
struct Architecture {
  const char* name;
  const char* model_type;
};
constexpr Architecture kArchitectures[] = {
    {"LlamaForCausalLM", "llama"}, {"MistralForCausalLM", "mistral"}, {"Qwen2ForCausalLM", "qwen2"}};

const Architecture& ArchitectureNamed(std::string_view name) {
  for (const Architecture& a : kArchitectures) {
    if (name == a.name) return a;
  }
  return kArchitectures[0];
}


}  // namespace

Status SaveHfCheckpoint(const fs::path& dir, const Llama& model) {
  const LlamaConfig& c = model.config();
  const Architecture& arch = ArchitectureNamed(c.architecture);
  nlohmann::ordered_json json = {
      {"architectures", {arch.name}},
      {"model_type", arch.model_type},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.num_heads},
      {"num_key_value_heads", c.num_kv_heads},
      {"head_dim", c.head_dim()},
      {"max_position_embeddings", c.max_position_embeddings > 0 ? c.max_position_embeddings : c.max_seq_len},
      {"rms_norm_eps", c.rms_norm_eps},
      {"rope_theta", c.rope_theta},
      {"rope_scaling", RopeScalingJson(c.rope_scaling)},
      {"tie_word_embeddings", c.tie_embeddings},
      {"hidden_act", "silu"},
      {"attention_dropout", 0.0},
      {"initializer_range", 0.02},
      {"torch_dtype", "float32"},
  };
  if (arch.name == std::string_view("LlamaForCausalLM")) {
    json["attention_bias"] = c.qkv_bias;
    json["mlp_bias"] = c.mlp_bias;
  } else {
    json["sliding_window"] = c.sliding_window > 0 ? nlohmann::ordered_json(c.sliding_window) : nullptr;
    if (arch.name == std::string_view("Qwen2ForCausalLM")) json["use_sliding_window"] = false;
  }
  return SaveTensorsAndConfig(dir, "model.safetensors", model.manifest(), model.parameters(), "config.json", json);
}

namespace {

// rope_scaling (transformers 4) or rope_parameters (transformers 5, which
// also carries rope_theta) into c; `key` names the object in errors.
Status ReadRope(const fs::path& path, const char* key, const nlohmann::json& rope, LlamaConfig& c) {
  const auto refuse = [&] {
    return InvalidArgument(
        "{}: '{}' is {}; only rope_type \"default\", \"linear\" and \"llama3\" are supported", path.string(), key,
        rope.dump());
  };
  if (!rope.is_object()) return refuse();
  // transformers 4.3x wrote the kind as "type".
  const nlohmann::json type =
      rope.contains("rope_type") ? rope["rope_type"] : rope.value("type", nlohmann::json("default"));
  if (type != "default" && type != "linear" && type != "llama3") return refuse();
  auto number = [&](const char* name, double* out, bool required) -> Status {
    if (!rope.contains(name)) {
      if (!required) return Status::Ok();
      return InvalidArgument("{}: '{}.{}' is missing (rope_type {})", path.string(), key, name, type.dump());
    }
    if (!rope[name].is_number()) {
      return InvalidArgument("{}: '{}.{}' is {}; expected a number", path.string(), key, name, rope[name].dump());
    }
    *out = rope[name].get<double>();
    return Status::Ok();
  };
  ESTUARY_RETURN_IF_ERROR(number("rope_theta", &c.rope_theta, false));
  RopeScaling& r = c.rope_scaling;
  if (type == "default") return Status::Ok();
  r.kind = type == "linear" ? RopeScaling::Kind::kLinear : RopeScaling::Kind::kLlama3;
  ESTUARY_RETURN_IF_ERROR(number("factor", &r.factor, true));
  if (r.kind == RopeScaling::Kind::kLinear) return Status::Ok();
  ESTUARY_RETURN_IF_ERROR(number("low_freq_factor", &r.low_freq_factor, true));
  ESTUARY_RETURN_IF_ERROR(number("high_freq_factor", &r.high_freq_factor, true));
  double original = 0;
  ESTUARY_RETURN_IF_ERROR(number("original_max_position_embeddings", &original, true));
  if (!(original >= 1 && original <= INT_MAX) || original != std::floor(original)) {
    return InvalidArgument("{}: '{}.original_max_position_embeddings' is {}; expected a positive integer",
                           path.string(), key, rope["original_max_position_embeddings"].dump());
  }
  r.original_max_position_embeddings = int(original);
  return Status::Ok();
}

// Reads config.json into a LlamaConfig, with transformers' defaults for its
// architecture where keys are absent; rejects what this implementation does not do.
Result<LlamaConfig> ReadConfigJson(const fs::path& path, int max_seq_len) {
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
  auto boolean = [&](const char* key, bool fallback, bool* out) -> Status {
    if (!json.contains(key)) {
      *out = fallback;
      return Status::Ok();
    }
    if (!json[key].is_boolean()) {
      return InvalidArgument("{}: '{}' is {}; expected true or false", path.string(), key, json[key].dump());
    }
    *out = json[key].get<bool>();
    return Status::Ok();
  };

  const Architecture* arch = &kArchitectures[0];  // a config.json without architectures is read as Llama's
  if (json.contains("architectures")) {
    const auto& names = json["architectures"];
    arch = nullptr;
    for (const Architecture& a : kArchitectures) {
      if (names.is_array() && std::find(names.begin(), names.end(), a.name) != names.end()) arch = &a;
    }
    if (!arch) {
      return InvalidArgument(
          "{}: 'architectures' is {}; expected it to list LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM",
          path.string(), names.dump());
    }
  }
  const std::string_view name = arch->name;
  const bool llama = name == "LlamaForCausalLM", mistral = name == "MistralForCausalLM", qwen2 = !llama && !mistral;
  ESTUARY_RETURN_IF_ERROR(config.Only("model_type", arch->model_type));
  ESTUARY_RETURN_IF_ERROR(config.Only("hidden_act", "silu"));
  if (!llama) {  // only LlamaForCausalLM has these switches
    ESTUARY_RETURN_IF_ERROR(config.Only("mlp_bias", false));
    if (mistral) ESTUARY_RETURN_IF_ERROR(config.Only("attention_bias", false));
  }

  LlamaConfig c;
  c.architecture = arch->name;
  // transformers' defaults for each architecture's absent keys.
  ESTUARY_RETURN_IF_ERROR(integer("vocab_size", qwen2 ? 151936 : 32000, &c.vocab_size));
  ESTUARY_RETURN_IF_ERROR(integer("hidden_size", 4096, &c.hidden_size));
  ESTUARY_RETURN_IF_ERROR(integer("intermediate_size", llama ? 11008 : mistral ? 14336 : 22016, &c.intermediate_size));
  ESTUARY_RETURN_IF_ERROR(integer("num_hidden_layers", 32, &c.num_layers));
  ESTUARY_RETURN_IF_ERROR(integer("num_attention_heads", 32, &c.num_heads));
  ESTUARY_RETURN_IF_ERROR(integer("num_key_value_heads", mistral ? 8 : c.num_heads, &c.num_kv_heads));
  ESTUARY_RETURN_IF_ERROR(
      integer("max_position_embeddings", llama ? 2048 : mistral ? 4096 * 32 : 32768, &c.max_position_embeddings));
  ESTUARY_RETURN_IF_ERROR(integer("head_dim", 0, &c.explicit_head_dim));
  ESTUARY_RETURN_IF_ERROR(number("rms_norm_eps", 1e-6, &c.rms_norm_eps));
  ESTUARY_RETURN_IF_ERROR(number("rope_theta", 10000.0, &c.rope_theta));
  ESTUARY_RETURN_IF_ERROR(boolean("tie_word_embeddings", false, &c.tie_embeddings));
  if (llama) {
    bool attention_bias = false;
    ESTUARY_RETURN_IF_ERROR(boolean("attention_bias", false, &attention_bias));
    c.qkv_bias = c.o_bias = attention_bias;
    ESTUARY_RETURN_IF_ERROR(boolean("mlp_bias", false, &c.mlp_bias));
  }
  if (qwen2) c.qkv_bias = true;  // Qwen2's q, k and v always have biases, its o_proj never
  if (json.contains("rope_scaling") && !json["rope_scaling"].is_null()) {
    ESTUARY_RETURN_IF_ERROR(ReadRope(path, "rope_scaling", json["rope_scaling"], c));
  }
  if (json.contains("rope_parameters") && !json["rope_parameters"].is_null()) {
    ESTUARY_RETURN_IF_ERROR(ReadRope(path, "rope_parameters", json["rope_parameters"], c));
  }
  c.max_seq_len = max_seq_len > 0 ? max_seq_len : c.max_position_embeddings;
  if (max_seq_len > c.max_position_embeddings) {
    return InvalidArgument("{}: a context of {} is longer than max_position_embeddings {}", path.string(),
                           max_seq_len, c.max_position_embeddings);
  }
  // A sliding window shorter than the context is a different attention.
  if (!llama) {
    bool windowed = mistral;
    if (qwen2) ESTUARY_RETURN_IF_ERROR(boolean("use_sliding_window", false, &windowed));
    if (json.contains("sliding_window") && !json["sliding_window"].is_null()) {
      ESTUARY_RETURN_IF_ERROR(integer("sliding_window", 0, &c.sliding_window));
      if (windowed && c.sliding_window < c.max_seq_len) {
        return InvalidArgument(
            "{}: 'sliding_window' is {}, shorter than the context of {} the model would run at; sliding-window "
            "attention is not supported (run at a context of at most {})",
            path.string(), c.sliding_window, c.max_seq_len, c.sliding_window);
      }
    } else if (mistral && !json.contains("sliding_window") && 4096 < c.max_seq_len) {
      return InvalidArgument(
          "{}: 'sliding_window' is absent, so 4096 (MistralConfig's default), shorter than the context of {}; "
          "sliding-window attention is not supported",
          path.string(), c.max_seq_len);
    }
  }
  Status valid = c.Validate();
  if (!valid.ok()) return InvalidArgument("{}: {}", path.string(), valid.message());
  return c;
}

// A sharded checkpoint's index: which shard holds each tensor.
struct ShardIndex {
  fs::path path;
  std::map<std::string, std::string> weight_map;  // tensor -> shard file name
  std::vector<std::string> shards;                // each once, sorted
};

Result<ShardIndex> ReadShardIndex(const fs::path& path) {
  ESTUARY_ASSIGN_OR_RETURN(const JsonConfig index, JsonConfig::Read(path, /*null_is_absent=*/false));
  if (!index.json.contains("weight_map") || !index.json["weight_map"].is_object()) {
    return InvalidArgument("{}: 'weight_map' is missing or not an object", path.string());
  }
  ShardIndex out{path, {}, {}};
  for (const auto& [tensor, shard] : index.json["weight_map"].items()) {
    // A shard is a file beside the index: no directories, no way out of it.
    if (!shard.is_string() || shard.get<std::string>().empty() ||
        shard.get<std::string>().find('/') != std::string::npos || shard.get<std::string>().starts_with(".")) {
      return InvalidArgument("{}: weight_map names {} for tensor '{}'; expected a file name beside the index",
                             path.string(), shard.dump(), tensor);
    }
    out.weight_map[tensor] = shard.get<std::string>();
    out.shards.push_back(shard.get<std::string>());
  }
  std::sort(out.shards.begin(), out.shards.end());
  out.shards.erase(std::unique(out.shards.begin(), out.shards.end()), out.shards.end());
  return out;
}

// ActivationsPerSequence, less under recompute the num_layers - 1 blocks'
// activations the arena no longer holds (llama.h: one block's region, which
// every block's forward overwrites, beside the residual streams).
double ArenaFloatsPerSequence(const LlamaConfig& config, bool recompute) {
  const double plain = config.ActivationsPerSequence();
  if (!recompute || config.num_layers <= 1) return plain;
  const double D = config.hidden_size, I = config.intermediate_size, H = config.num_heads, KV = config.num_kv_heads,
               S = config.max_seq_len, hd = config.head_dim();
  const double block = H * S * S + S * (4 * D + (2 * H + 2 * KV) * hd + 3 * I);
  return plain - (config.num_layers - 1) * block;
}

Status CheckMemory(const fs::path& dir, const LlamaConfig& config, int max_batch, uint64_t max_bytes,
                   bool recompute) {
  const bool physical = max_bytes == 0;
  const double limit = physical ? double(PhysicalMemoryBytes()) : double(max_bytes);
  const char* const of = physical ? "this machine's physical memory" : "max_bytes";
  constexpr double kGiB = 1024.0 * 1024 * 1024;
  const double parameters = config.ParameterCount(), needed = parameters * 2 * sizeof(float);
  if (needed > limit) {
    return FailedPrecondition(
        "{}: {} parameters x 4 bytes x 2 (fp32 weights and gradients) = {:.0f} bytes ({:.2f} GiB), more than the "
        "{:.0f} bytes ({:.2f} GiB) of {}",
        dir.string(), parameters, needed, needed / kGiB, limit, limit / kGiB, of);
  }
  // The activation arena is mapped, not touched, but a published context of
  // 128k tokens asks for terabytes of address space.
  const double arena = ArenaFloatsPerSequence(config, recompute) * max_batch * sizeof(float);
  if (arena > limit) {
    return FailedPrecondition(
        "{}: the activation arena for {} x {} tokens (max_position_embeddings, or the context asked for){} would "
        "map {:.0f} bytes ({:.2f} GiB), more than the {:.0f} bytes ({:.2f} GiB) of {}; load at a shorter context{}",
        dir.string(), max_batch, config.max_seq_len,
        recompute ? fmt::format(" with recompute (one block's activations, not {})", config.num_layers) : "", arena,
        arena / kGiB, limit, limit / kGiB, of, recompute ? "" : ", or with recompute");
  }
  return Status::Ok();
}

}  // namespace

uint64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? uint64_t(pages) * uint64_t(page) : UINT64_MAX;
}

Result<LlamaConfig> ReadHfConfig(const fs::path& dir, int max_seq_len) {
  return ReadConfigJson(dir / "config.json", max_seq_len);
}

Result<Llama> LoadHfCheckpoint(const fs::path& dir, int max_batch) {
  return LoadHfCheckpoint(dir, HfLoadOptions{.max_batch = max_batch});
}

Result<Llama> LoadHfCheckpoint(const fs::path& dir, const HfLoadOptions& options) {
  ESTUARY_ASSIGN_OR_RETURN(LlamaConfig config, ReadConfigJson(dir / "config.json", options.max_seq_len));
  // Older transformers saved this non-trainable buffer; it is recomputed from rope_theta.
  auto recomputed = [](std::string_view name) { return name.ends_with("self_attn.rotary_emb.inv_freq"); };
  const std::string expected = fmt::format("not part of this config's {}{}", config.architecture,
                                           config.tie_embeddings ? ", whose embeddings are tied" : "");
  const CheckpointReadOptions widen{.widen_half = true};
  // As from_pretrained: the single file where there is one, else the index.
  const fs::path index_path = dir / "model.safetensors.index.json";
  std::error_code error;
  if (fs::exists(dir / "model.safetensors", error) || !fs::exists(index_path, error)) {
    const fs::path file = dir / "model.safetensors";
    ESTUARY_ASSIGN_OR_RETURN(Checkpoint checkpoint, LoadCheckpoint(file, widen));
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
    ESTUARY_RETURN_IF_ERROR(CheckMemory(dir, config, options.max_batch, options.max_bytes, options.recompute));
    ESTUARY_ASSIGN_OR_RETURN(Llama model, Llama::Create(config, options.max_batch, options.recompute));
    ESTUARY_RETURN_IF_ERROR(CopyCheckedTensors(file, checkpoint, model.manifest(), model.parameters(),
                                               "config.json implies", expected, recomputed));
    return model;
  }

  // Sharded: the index names every tensor's shard. Names first (no shard
  // read yet), then each shard, one at a time, into the model.
  ESTUARY_ASSIGN_OR_RETURN(const ShardIndex index, ReadShardIndex(index_path));
  if (TensorCountOf(config) > 2 * int64_t(index.weight_map.size()) + 16) {
    return InvalidArgument("{}: config.json implies {} tensors ({} layers), but weight_map names {}",
                           index_path.string(), TensorCountOf(config), config.num_layers, index.weight_map.size());
  }
  const LlamaLayout layout = LayoutOf(config);
  for (const TensorSpec& want : layout.manifest.tensors) {
    if (!index.weight_map.count(want.name)) {
      return InvalidArgument("{}: tensor '{}' is missing from weight_map", index_path.string(), want.name);
    }
  }
  for (const auto& [tensor, shard] : index.weight_map) {
    if (!layout.manifest.Find(tensor) && !recomputed(tensor)) {
      return InvalidArgument("{}: unexpected tensor '{}' ({})", index_path.string(), tensor, expected);
    }
  }
  ESTUARY_RETURN_IF_ERROR(CheckMemory(dir, config, options.max_batch, options.max_bytes, options.recompute));
  ESTUARY_ASSIGN_OR_RETURN(Llama model, Llama::Create(config, options.max_batch, options.recompute));
  std::map<std::string, std::string> found;  // tensor -> the shard it was read from
  for (const std::string& shard : index.shards) {
    const fs::path file = dir / shard;
    ESTUARY_ASSIGN_OR_RETURN(const Checkpoint checkpoint, LoadCheckpoint(file, widen));
    for (const TensorSpec& got : checkpoint.manifest.tensors) {
      const auto named = index.weight_map.find(got.name);
      if (named == index.weight_map.end()) {
        return InvalidArgument("{}: tensor '{}' is not in {}'s weight_map", file.string(), got.name,
                               index_path.filename().string());
      }
      if (const auto seen = found.find(got.name); seen != found.end()) {
        return InvalidArgument("{}: tensor '{}' is also in {}", file.string(), got.name, seen->second);
      }
      found[got.name] = shard;
      if (named->second != shard) {
        return InvalidArgument("{}: tensor '{}' is here, but weight_map names {}", file.string(), got.name,
                               named->second);
      }
      const TensorSpec* want = model.manifest().Find(got.name);
      if (!want) continue;  // a recomputed buffer
      if (got.shape != want->shape) {
        return InvalidArgument("{}: tensor '{}' has shape [{}], but config.json implies [{}]", file.string(),
                               got.name, fmt::join(got.shape, ", "), fmt::join(want->shape, ", "));
      }
      std::memcpy(model.parameters().data() + want->offset, checkpoint.data.data() + got.offset,
                  sizeof(float) * want->numel());
    }
  }
  for (const auto& [tensor, shard] : index.weight_map) {
    if (!found.count(tensor)) {
      return InvalidArgument("{}: tensor '{}' is missing (weight_map names this shard)", (dir / shard).string(),
                             tensor);
    }
  }
  return model;
}

}  // namespace estuary::models
