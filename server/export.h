// Export: a committed round's global model in the formats other tools load
// (`estuary-server export`).
//
// The round's checkpoint is read and its SHA-256 checked against the round
// log first. A LoRA federation's model is written as three directories:
//   adapter/  the global adapter in PEFT's layout (adapter_model.safetensors,
//             adapter_config.json), for PeftModel.from_pretrained;
//   base/     the Hugging Face model it applies to: the pretrained base, and
//             under the exact merge that base with the residuals folded in
//             (so with exact, the adapter belongs to this base, not the
//             original one);
//   merged/   base + (alpha/r)·B·A as one Hugging Face model.
// On a Hugging Face base (the checkpoint's hf_base_* metadata) the shape is
// the checkpoint's, adapter_config.json's base_model_name_or_path is the
// server's base directory, and base/ and merged/ get that directory's
// config.json and tokenizer files (copied as they are) where it is readable.
// A full federation of a decoder is written as model/ (Hugging Face). The
// image models' checkpoints are safetensors files already: refused, saying so.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "base/status.h"
#include "server/store.h"

namespace estuary::server {

struct ExportResult {
  uint64_t round = 0;
  std::string checksum;                       // the round's model sha256
  std::vector<std::filesystem::path> written;  // the directories, in the order above
  std::string description;                    // one line for the operator
};

// round: the last committed one when absent. Errors name the round, the
// checkpoint file or what the checkpoint lacks, in one line.
Result<ExportResult> ExportRound(Store& store, std::optional<uint64_t> round, const std::filesystem::path& out);

}  // namespace estuary::server
