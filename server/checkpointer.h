// Checkpointer: the server's model files, and the only code that knows
// their format.
//
// When round r commits, its directory holds global-r{r:05}.safetensors: the
// global model, with the metadata round, model, sha256, strategy and
// update_kind, and in a lora federation lora_rank, lora_alpha, lora_targets,
// lora_merge and lora_dropout (what `estuary-server export` reads). Beside
// it, the same name plus ".strategy" holds the federation's cross-round state
// (named flat tensors: the strategy's, Strategy::SaveState, and the update
// bound's) when there is any. Each file is written atomically
// (models/checkpoint.h). At recovery Load reads the model back, refuses it
// unless its layout and SHA-256 agree with the federation's model and the
// round log, and hands the state back.
// Write runs on the worker while the I/O thread goes on: it reads only what
// it was given and its own constant members.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "aggregation/lora_strategy.h"
#include "aggregation/strategy.h"
#include "base/manifest.h"
#include "base/status.h"
#include "estuary.pb.h"

namespace estuary::server {

class Checkpointer {
 public:
  // Writes into `dir`, created if need be, the checkpoints of a federation
  // training `task` (with `lora`: a lora federation's options).
  static Result<Checkpointer> Open(std::filesystem::path dir, const v1::TaskConfig& task,
                                   const std::optional<aggregation::LoraStrategyOptions>& lora);

  using State = std::map<std::string, std::vector<float>>;

  // Writes round `round`'s global model (of layout `manifest`, whose sha256
  // hex is `checksum`, merged by `strategy`) and `state`; returns the model
  // file's path.
  Result<std::filesystem::path> Write(uint64_t round, const Manifest& manifest, std::span<const float> global,
                                      const std::string& checksum, std::string_view strategy,
                                      const State& state) const;
  struct Loaded {
    std::vector<float> values;
    State state;  // empty when none was written
  };
  // Reads the model file at `path` back: it must be of layout `manifest` and
  // hash to `logged_checksum`, the round log's; and the state beside it.
  Result<Loaded> Load(const std::filesystem::path& path, const Manifest& manifest,
                      const std::string& logged_checksum) const;

  const std::filesystem::path& dir() const { return dir_; }

 private:
  Checkpointer(std::filesystem::path dir, std::string model, std::map<std::string, std::string> metadata)
      : dir_(std::move(dir)), model_(std::move(model)), metadata_(std::move(metadata)) {}

  std::filesystem::path dir_;
  std::string model_;
  std::map<std::string, std::string> metadata_;  // what every round's file says of the federation
};

}  // namespace estuary::server
