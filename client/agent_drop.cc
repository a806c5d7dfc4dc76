// The Agent's simulated dropouts in rounds without secure aggregation
// (AgentOptions::upload_drop): the connection closes where a site that died
// there would lose it, and the agent reconnects after its backoff, as after
// any lost connection. The server records the site as dropped from the round
// and discards whatever it had staged of its upload.
#include <spdlog/spdlog.h>

#include "client/agent.h"

namespace estuary::client {

bool Agent::DropsAfterTraining(uint64_t round, const Update& update) {
  upload_drop_at_ = UINT64_MAX;
  const UploadDrop drop = options_.upload_drop ? options_.upload_drop(round, name_) : UploadDrop::kNone;
  if (drop == UploadDrop::kAfterTraining) {
    Disconnected(fmt::format("round {}: dropping out after training, before uploading", round));
    return true;
  }
  if (drop == UploadDrop::kMidUpload) {
    // Half the update's bytes (the delta, then SCAFFOLD's Δc_i), in whole elements.
    const uint64_t elements = update.manifest.total_elements + update.control_delta.size();
    upload_drop_at_ = elements / 2 * sizeof(float);
  }
  return false;
}

bool Agent::DropsMidUpload() {
  if (!upload_ || upload_offset_ < upload_drop_at_ || !outbox_.empty()) return false;
  const uint64_t total = (upload_->manifest.total_elements + upload_->control_delta.size()) * sizeof(float);
  DropUpload();  // nothing more of it is written, even by its checksum arriving later
  Disconnected(fmt::format("round {}: dropping out mid-upload, after {} of {} bytes", upload_round_, upload_offset_,
                           total));
  return true;
}

}  // namespace estuary::client
