// TensorBoard event files: scalars per step, as `tensorboard --logdir DIR`
// shows them. The server (`serve --tensorboard DIR`) and the simulator write
// one per run, a point per round.
//
// The format is TFRecord: per record its length (uint64, little-endian), the
// masked CRC32C of those 8 bytes, the data (a serialized tensorboard.Event)
// and the masked CRC32C of the data; the first record says the file version.
// The file is DIR/events.out.tfevents.<unix seconds>.<host>.<pid>.<n>.<tag>,
// so runs never collide, and is flushed after every step, so a reader follows a
// live run.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "base/status.h"

namespace estuary::proto {

// CRC-32C (Castagnoli), and TFRecord's mask of it.
uint32_t Crc32c(std::string_view bytes);
uint32_t MaskedCrc32c(std::string_view bytes);

class EventFile {
 public:
  // Creates DIR (and its parents) and a new event file in it; `tag` ends its name ("server", "sim").
  static Result<std::unique_ptr<EventFile>> Create(const std::filesystem::path& dir, std::string_view tag);
  ~EventFile();
  EventFile(const EventFile&) = delete;
  EventFile& operator=(const EventFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // One event at `step` holding every scalar of `values` (tag -> value), then a flush.
  Status WriteScalars(int64_t step, const std::map<std::string, double>& values);

 private:
  EventFile(std::filesystem::path path, FILE* file) : path_(std::move(path)), file_(file) {}
  Status WriteRecord(const std::string& data);

  std::filesystem::path path_;
  FILE* file_;
};

}  // namespace estuary::proto
