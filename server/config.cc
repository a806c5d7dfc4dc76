#include "server/config.h"

#include <charconv>

namespace estuary::server {

Status ParseHostPort(const std::string& text, std::string* host, uint16_t* port) {
  std::string h, p;
  if (!text.empty() && text.front() == '[') {
    const auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return InvalidArgument("address '{}': expected [IPV6]:PORT", text);
    }
    h = text.substr(1, close - 1);
    p = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos || colon == 0) return InvalidArgument("address '{}': expected HOST:PORT", text);
    h = text.substr(0, colon);
    p = text.substr(colon + 1);
  }
  unsigned value = 0;
  auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), value);
  if (ec != std::errc() || end != p.data() + p.size() || value > 65535) {
    return InvalidArgument("address '{}': bad port '{}'", text, p);
  }
  *host = h;
  *port = static_cast<uint16_t>(value);
  return Status::Ok();
}

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
  if (task.epochs() == 0) return InvalidArgument("config: epochs = 0: must be >= 1");
  if (task.batch_size() == 0) return InvalidArgument("config: batch = 0: must be >= 1");
  if (!(task.learning_rate() > 0)) return InvalidArgument("config: lr = {}: must be > 0", task.learning_rate());
  return Status::Ok();
}

}  // namespace estuary::server
