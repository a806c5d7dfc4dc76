#include "server/export.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>

#include "base/split.h"
#include "crypto/sha256.h"
#include "models/checkpoint.h"
#include "models/custom_model.h"
#include "models/hf_base.h"
#include "models/language_model.h"
#include "models/llama.h"
#include "models/lora.h"
#include "models/lora_federation.h"

namespace estuary::server {
namespace {

Result<std::string> Meta(const models::Checkpoint& checkpoint, const std::string& key, const std::string& path) {
  const auto it = checkpoint.metadata.find(key);
  if (it == checkpoint.metadata.end()) {
    return InvalidArgument("export: {}: the checkpoint's metadata has no '{}' (written by an older server?)", path, key);
  }
  return it->second;
}

// The adapter config the server wrote beside a LoRA round's weights.
Result<models::LoraConfig> LoraConfigOf(const models::Checkpoint& checkpoint, const std::string& path) {
  models::LoraConfig lora;
  ESTUARY_ASSIGN_OR_RETURN(const std::string rank, Meta(checkpoint, "lora_rank", path));
  ESTUARY_ASSIGN_OR_RETURN(const std::string alpha, Meta(checkpoint, "lora_alpha", path));
  ESTUARY_ASSIGN_OR_RETURN(const std::string targets, Meta(checkpoint, "lora_targets", path));
  const auto parsed = std::from_chars(rank.data(), rank.data() + rank.size(), lora.rank);
  char* end = nullptr;
  lora.alpha = std::strtof(alpha.c_str(), &end);
  if (parsed.ec != std::errc() || end == alpha.c_str() || *end != '\0') {
    return InvalidArgument("export: {}: lora_rank '{}' or lora_alpha '{}' is not a number", path, rank, alpha);
  }
  if (const auto dropout = checkpoint.metadata.find("lora_dropout"); dropout != checkpoint.metadata.end()) {
    lora.dropout = std::strtof(dropout->second.c_str(), nullptr);  // recorded for the config file; unused here
  }
  lora.target_modules = SplitCommas(targets);  // LoraConfig's default targets are not the federation's
  return lora;
}

// A decoder of `config` holding `weights` (its manifest's layout).
Result<models::Llama> DecoderWith(const models::LlamaConfig& config, std::span<const float> weights) {
  ESTUARY_ASSIGN_OR_RETURN(models::Llama model, models::Llama::Create(config, 1));
  if (weights.size() != model.parameters().size()) {
    return Internal("export: {} weights for a decoder of {}", weights.size(), model.parameters().size());
  }
  std::copy(weights.begin(), weights.end(), model.parameters().begin());
  return model;
}

// The base directory's config.json (over the one SaveHfCheckpoint wrote from
// the shape: the same keys, plus what the base's authors put there) and its
// tokenizer files, into each of `to`. Says what was copied; a base directory
// that is gone leaves the written config.json and says so.
Result<std::string> CopyBaseFiles(const std::filesystem::path& from, const std::vector<std::filesystem::path>& to) {
  std::error_code error;
  if (!std::filesystem::exists(from / "config.json", error)) {
    return fmt::format("{} is not readable here: config.json written from the shape, no tokenizer files",
                       (from / "config.json").string());
  }
  std::vector<std::string> names;
  for (const char* name : {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                           "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt"}) {
    if (!std::filesystem::exists(from / name, error)) continue;
    for (const std::filesystem::path& dir : to) {
      std::filesystem::copy_file(from / name, dir / name, std::filesystem::copy_options::overwrite_existing, error);
      if (error) return IoError("export: copy {} to {}: {}", (from / name).string(), dir.string(), error.message());
    }
    names.push_back(name);
  }
  return fmt::format("copied {}", fmt::join(names, ", "));
}

}  // namespace

Result<ExportResult> ExportRound(Store& store, std::optional<uint64_t> round, const std::filesystem::path& out) {
  std::optional<RoundRecord> record;
  if (round) {
    ESTUARY_ASSIGN_OR_RETURN(record, store.GetRound(*round));
    if (!record) return NotFound("export: round {} is not in the log", *round);
    if (record->state != RoundState::kCommitted) {
      return FailedPrecondition("export: round {} is {}, not committed: it has no model", *round,
                                RoundStateName(record->state));
    }
  } else {
    ESTUARY_ASSIGN_OR_RETURN(record, store.LastCommittedRound());
    if (!record) return NotFound("export: no round is committed yet");
  }
  ESTUARY_ASSIGN_OR_RETURN(const auto path_row, store.CheckpointFor(record->round));
  if (!path_row) return FailedPrecondition("export: round {} is committed but has no checkpoint row", record->round);
  const std::string& path = *path_row;
  ESTUARY_ASSIGN_OR_RETURN(models::Checkpoint checkpoint, models::LoadCheckpoint(path));
  const std::string checksum = crypto::Sha256Hex(checkpoint.data.data(), checkpoint.data.size() * sizeof(float));
  if (checksum != record->global_checksum) {
    return FailedPrecondition("export: {}: sha256 {} differs from round {}'s {} in the log", path,
                              checksum.substr(0, 12), record->round, record->global_checksum.substr(0, 12));
  }
  ESTUARY_ASSIGN_OR_RETURN(const std::string model_name, Meta(checkpoint, "model", path));
  // A federation on a Hugging Face base: the shape is the checkpoint's, the config and tokenizer its directory's.
  std::filesystem::path hf_base_dir;
  if (const auto shape = checkpoint.metadata.find("hf_base_shape"); shape != checkpoint.metadata.end()) {
    auto config = models::ParseCanonicalShape(shape->second);
    if (!config.ok()) return InvalidArgument("export: {}: {}", path, config.status().message());
    ESTUARY_RETURN_IF_ERROR(models::RegisterHfModel(model_name, *config));
    ESTUARY_ASSIGN_OR_RETURN(const std::string dir, Meta(checkpoint, "hf_base_dir", path));
    hf_base_dir = dir;
  }
  if (checkpoint.metadata.contains("custom_layout")) {
    // A model known only as a file: written back as one, with the file's names, shapes and dtypes.
    const std::map<std::string, std::string> metadata = {{"model", model_name},
                                                         {"round", std::to_string(record->round)},
                                                         {"sha256", checksum}};
    ESTUARY_ASSIGN_OR_RETURN(const models::CustomModel custom,
                             models::CustomModelFromMetadata(checkpoint.metadata, std::move(checkpoint.data), path));
    if (custom.name != model_name) {
      return FailedPrecondition("export: {}: the tensors it describes are {}, not the federation's {}", path,
                                custom.name, model_name);
    }
    std::error_code error;
    std::filesystem::create_directories(out, error);
    if (error) return IoError("export: cannot create {}: {}", out.string(), error.message());
    ExportResult result{.round = record->round, .checksum = checksum, .written = {out / "model.safetensors"}};
    ESTUARY_RETURN_IF_ERROR(models::SaveCustomModel(result.written[0], custom, metadata));
    result.description = fmt::format("round {} of {}: {} tensors with the initial file's names, shapes and dtypes "
                                     "({} held as it had them)",
                                     record->round, model_name, custom.layout.size(), custom.held.size());
    return result;
  }
  if (!models::IsLanguageModel(model_name)) {
    return InvalidArgument("export: model '{}' is not a decoder; its checkpoint {} is a safetensors file already",
                           model_name, path);
  }
  ESTUARY_ASSIGN_OR_RETURN(const models::LlamaConfig config, models::LlamaPreset(model_name));
  ExportResult result{.round = record->round, .checksum = checksum};
  const auto update_kind = checkpoint.metadata.find("update_kind");
  if (update_kind == checkpoint.metadata.end() || update_kind->second != "lora") {
    ESTUARY_ASSIGN_OR_RETURN(models::Llama model, DecoderWith(config, checkpoint.data));
    result.written = {out / "model"};
    ESTUARY_RETURN_IF_ERROR(models::SaveHfCheckpoint(result.written[0], model));
    result.description = fmt::format("round {} of a full {} federation: a Hugging Face model", record->round, model_name);
    if (!hf_base_dir.empty()) {
      ESTUARY_ASSIGN_OR_RETURN(const std::string copied, CopyBaseFiles(hf_base_dir, {result.written[0]}));
      result.description += fmt::format(", trained from base {}: {}", hf_base_dir.string(), copied);
    }
    return result;
  }

  ESTUARY_ASSIGN_OR_RETURN(models::LoraConfig lora, LoraConfigOf(checkpoint, path));
  if (!hf_base_dir.empty()) lora.base_model_name_or_path = hf_base_dir.string();
  ESTUARY_ASSIGN_OR_RETURN(const models::LoraGlobalLayout layout, models::MakeLoraGlobalLayout(config, lora));
  if (!(checkpoint.manifest == layout.global)) {
    return FailedPrecondition("export: {}: the tensors do not form {} with rank-{} adapters on {}", path, model_name,
                              lora.rank, fmt::join(lora.target_modules, ","));
  }
  const std::span<const float> all(checkpoint.data);
  ESTUARY_ASSIGN_OR_RETURN(models::Llama base, DecoderWith(config, all.first(layout.adapter_offset())));
  const std::filesystem::path base_dir = out / "base", adapter_dir = out / "adapter", merged_dir = out / "merged";
  ESTUARY_RETURN_IF_ERROR(models::SaveHfCheckpoint(base_dir, base));
  ESTUARY_ASSIGN_OR_RETURN(models::LoraLlama adapted, models::LoraLlama::Create(std::move(base), lora));
  const auto adapter = all.subspan(layout.adapter_offset());
  std::copy(adapter.begin(), adapter.end(), adapted.parameters().begin());
  ESTUARY_RETURN_IF_ERROR(models::SaveLoraAdapter(adapter_dir, adapted));
  ESTUARY_RETURN_IF_ERROR(models::SaveMergedHfCheckpoint(merged_dir, adapted));
  result.written = {adapter_dir, base_dir, merged_dir};
  std::string copied;
  if (!hf_base_dir.empty()) {
    ESTUARY_ASSIGN_OR_RETURN(copied, CopyBaseFiles(hf_base_dir, {base_dir, merged_dir}));
  }
  const auto merge = checkpoint.metadata.find("lora_merge");
  const std::string rule = merge == checkpoint.metadata.end() ? "?" : merge->second;
  result.description = fmt::format(
      "round {} of a lora {} federation ({} merge): a PEFT adapter (r {}, alpha {}, {}), the base it applies to{}, "
      "and the merged model",
      record->round, model_name, rule, lora.rank, lora.alpha, fmt::join(lora.target_modules, ","),
      rule == "exact" ? " (the pretrained base with exact's residuals folded in)" : "");
  if (!hf_base_dir.empty()) result.description += fmt::format("; from base {}: {}", hf_base_dir.string(), copied);
  return result;
}

}  // namespace estuary::server
