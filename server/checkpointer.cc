#include "server/checkpointer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "crypto/sha256.h"
#include "models/checkpoint.h"

namespace estuary::server {

Result<Checkpointer> Checkpointer::Open(std::filesystem::path dir, const v1::TaskConfig& task,
                                        const std::optional<aggregation::LoraStrategyOptions>& lora,
                                        const LogView& log, const std::filesystem::path& hf_base_dir,
                                        const std::map<std::string, std::string>& extra) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return IoError("server: {}: cannot create checkpoint directory: {}", dir.string(), ec.message());
  std::map<std::string, std::string> metadata = {{"model", task.model()}, {"update_kind", lora ? "lora" : "full"}};
  if (lora) {
    // What `estuary-server export` needs to write the adapter in PEFT's layout.
    const auto& targets = task.lora().target_modules();
    metadata["lora_rank"] = std::to_string(lora->merge.rank);
    metadata["lora_alpha"] = fmt::format("{}", lora->merge.alpha);
    metadata["lora_targets"] = fmt::format("{}", fmt::join(targets.begin(), targets.end(), ","));
    metadata["lora_merge"] = task.lora().merge();
    metadata["lora_dropout"] = fmt::format("{}", task.lora().dropout());
  }
  if (task.has_hf_base()) {
    metadata["hf_base_sha256"] = task.hf_base().sha256();
    metadata["hf_base_shape"] = task.hf_base().shape();
    metadata["hf_base_dir"] = std::filesystem::absolute(hf_base_dir).lexically_normal().string();
  }
  metadata.insert(extra.begin(), extra.end());
  Checkpointer checkpointer(std::move(dir), task.model(), std::move(metadata));
  ESTUARY_RETURN_IF_ERROR(checkpointer.Reconcile(log));
  return checkpointer;
}

static std::filesystem::path StateFileOf(const std::filesystem::path& checkpoint) {
  return checkpoint.string() + ".strategy";
}

Result<std::filesystem::path> Checkpointer::Write(uint64_t round, const Manifest& manifest,
                                                  std::span<const float> global, const std::string& checksum,
                                                  std::string_view strategy, const State& state) const {
  const auto file = dir_ / fmt::format("global-r{:05}.safetensors", round);
  if (round <= last_committed_) {
    return FailedPrecondition("server: {}: round {} is committed; its checkpoint is never written again",
                              file.string(), round);
  }
  std::map<std::string, std::string> metadata = metadata_;
  metadata["round"] = std::to_string(round);
  metadata["sha256"] = checksum;
  metadata["strategy"] = std::string(strategy);
  ESTUARY_RETURN_IF_ERROR(models::SaveCheckpoint(file, manifest, global, metadata));
  if (!state.empty()) {
    Manifest state_manifest;
    std::vector<float> flat;
    for (const auto& [name, values] : state) {
      state_manifest.tensors.push_back({name, {int64_t(values.size())}, DType::kF32, flat.size()});
      flat.insert(flat.end(), values.begin(), values.end());
    }
    state_manifest.total_elements = flat.size();
    ESTUARY_RETURN_IF_ERROR(
        models::SaveCheckpoint(StateFileOf(file), state_manifest, flat, {{"round", std::to_string(round)}}));
  }
  return file;
}

Result<Checkpointer::Loaded> Checkpointer::Load(const std::filesystem::path& path, const Manifest& manifest,
                                                const std::string& logged_checksum) const {
  ESTUARY_ASSIGN_OR_RETURN(auto checkpoint, models::LoadCheckpoint(path));
  if (!(checkpoint.manifest == manifest)) {
    return FailedPrecondition("server: {}: checkpoint does not match model '{}'", path.string(), model_);
  }
  const auto id = checkpoint.metadata.find("federation_id");
  if (id != checkpoint.metadata.end() && id->second != federation_id_) {
    return FailedPrecondition("server: {}: a checkpoint of federation {}, not of this one ({})", path.string(),
                              id->second, federation_id_);
  }
  const std::string checksum = crypto::Sha256Hex(checkpoint.data.data(), checkpoint.data.size() * sizeof(float));
  if (checksum != logged_checksum) {
    return FailedPrecondition("server: {}: checksum {} but the round log says {}", path.string(), checksum,
                              logged_checksum);
  }
  Loaded loaded;
  const std::filesystem::path state_path = StateFileOf(path);
  if (std::filesystem::exists(state_path)) {
    ESTUARY_ASSIGN_OR_RETURN(auto state_file, models::LoadCheckpoint(state_path));
    for (const auto& spec : state_file.manifest.tensors) {
      auto begin = state_file.data.begin() + spec.offset;
      loaded.state[spec.name].assign(begin, begin + spec.numel());
    }
  }
  loaded.values = std::move(checkpoint.data);
  return loaded;
}

}  // namespace estuary::server
