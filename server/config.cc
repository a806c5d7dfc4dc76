#include "server/config.h"


namespace estuary::server {

Status ServerConfig::Finalize() {
  std::string host;
  uint16_t port;
  ESTUARY_RETURN_IF_ERROR(ParseHostPort(listen, &host, &port));
  if (checkpoint_dir.empty()) checkpoint_dir = db.string() + ".checkpoints";
  if (spill_dir.empty()) spill_dir = checkpoint_dir;
  if (rounds == 0) return InvalidArgument("config: rounds = 0: must be >= 1");
  if (!(clients_per_round > 0)) return InvalidArgument("config: clients_per_round = {}: must be > 0", clients_per_round);
  if (min_clients == 0) return InvalidArgument("config: min_clients = 0: must be >= 1");
  if (min_updates == 0) return InvalidArgument("config: min_updates = 0: must be >= 1");
  if (!(round_deadline_s > 0)) return InvalidArgument("config: round_deadline = {}: must be > 0", round_deadline_s);
  if (max_frame_bytes < 4096) return InvalidArgument("config: max_frame = {}: must be >= 4096", max_frame_bytes);
  if (chunk_bytes < 4 || chunk_bytes % 4 != 0 || chunk_bytes + 1024 > max_frame_bytes) {
    return InvalidArgument("config: chunk_bytes = {}: must be a multiple of 4 and fit in a frame of {}", chunk_bytes,
                           max_frame_bytes);
  }
  if (staging_slots == 0) return InvalidArgument("config: staging_slots = 0: must be >= 1");
  for (const auto& [key, seconds] : {std::pair{"handshake_timeout", handshake_timeout_s},
                                     {"idle_timeout", idle_timeout_s},
                                     {"write_timeout", write_timeout_s},
                                     {"download_slot_timeout", download_slot_timeout_s},
                                     {"event_interval", event_interval_s}}) {
    if (!(seconds > 0)) return InvalidArgument("config: {} = {}: must be > 0", key, seconds);
  }
  if (max_handshakes == 0) return InvalidArgument("config: max_handshakes = 0: must be >= 1");
  if (max_handshakes_per_address == 0) return InvalidArgument("config: max_handshakes_per_address = 0: must be >= 1");
  if (io_threads == 0) return InvalidArgument("config: io_threads = 0: must be >= 1");
  if (frame_memory_bytes < max_frame_bytes) {
    return InvalidArgument("config: frame_memory = {}: must hold one frame of max_frame = {}", frame_memory_bytes,
                           max_frame_bytes);
  }
  return aggregation::CheckFederation(federation);
}

}  // namespace estuary::server
