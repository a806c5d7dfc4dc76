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
//
// The directory and the round log know each other, so that neither can be
// emptied, deleted, swapped or rolled back under the other unnoticed: the
// directory's FEDERATION file holds the federation's id (also in every
// model file's metadata and in the log's meta table) and the last round
// committed, advanced after each commit (MarkCommitted). Open compares it
// with what the log says and refuses, in one line, a log that holds less
// than the directory (missing, empty, truncated, or a lost WAL), another
// federation's log, or a log without its directory. A committed round's
// file is never written again; files of a round written but never
// committed, and temporaries of a killed write, are removed at Open.
//
// Write runs on the worker while the I/O thread goes on: it reads only what
// it was given and members that change only between rounds.
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
  // What the round log says of the federation it records.
  struct LogView {
    std::string path;                          // for messages
    std::optional<std::string> federation_id;  // its meta table's
    uint64_t last_committed = 0;               // 0: none
  };

  // Writes into `dir`, created if need be, the checkpoints of a federation
  // training `task` (with `lora`: a lora federation's options), reconciled
  // with `log` as above. A new federation gets a fresh id (is_new()); the
  // caller records it in the log. On a Hugging Face base (task.hf_base)
  // every checkpoint's metadata also holds its shape, identity and
  // `hf_base_dir` (the server's copy), from which `estuary-server export`
  // writes the merged model with the base's config and tokenizer files.
  // `extra` joins every checkpoint's metadata: a model known only as a
  // file's layout and held tensors (models::CustomModelMetadata), so that
  // `estuary-server export` writes it back with its own dtypes.
  static Result<Checkpointer> Open(std::filesystem::path dir, const v1::TaskConfig& task,
                                   const std::optional<aggregation::LoraStrategyOptions>& lora, const LogView& log,
                                   const std::filesystem::path& hf_base_dir = {},
                                   const std::map<std::string, std::string>& extra = {});

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

  // Records in the directory that the log committed `round`: call after the
  // log's commit, before another Write.
  Status MarkCommitted(uint64_t round);

  const std::filesystem::path& dir() const { return dir_; }
  const std::string& federation_id() const { return federation_id_; }
  bool is_new() const { return is_new_; }
  // What Open removed (leftovers of a killed write or an uncommitted round).
  const std::vector<std::string>& removed() const { return removed_; }

 private:
  Checkpointer(std::filesystem::path dir, std::string model, std::map<std::string, std::string> metadata)
      : dir_(std::move(dir)), model_(std::move(model)), metadata_(std::move(metadata)) {}
  // Brings the directory into agreement with `log`, or says why it cannot.
  Status Reconcile(const LogView& log);

  std::filesystem::path dir_;
  std::string model_;
  std::map<std::string, std::string> metadata_;  // what every round's file says of the federation
  std::string federation_id_;
  uint64_t last_committed_ = 0;
  bool is_new_ = false;
  std::vector<std::string> removed_;
};

}  // namespace estuary::server
