#include "proto/event_file.h"

#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "tensorboard.pb.h"

namespace estuary::proto {
namespace {

// The reflected Castagnoli polynomial, one byte at a time: a few hundred
// bytes a round need nothing faster.
constexpr std::array<uint32_t, 256> kCrc32cTable = [] {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1) ? 0x82F63B78u : 0);
    table[i] = crc;
  }
  return table;
}();

double UnixSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t Crc32c(std::string_view bytes) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char byte : bytes) crc = kCrc32cTable[(crc ^ byte) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t MaskedCrc32c(std::string_view bytes) {
  const uint32_t crc = Crc32c(bytes);
  return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
}

Result<std::unique_ptr<EventFile>> EventFile::Create(const std::filesystem::path& dir, std::string_view tag) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return IoError("tensorboard: {}: cannot create the directory: {}", dir.string(), ec.message());
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  const auto now = static_cast<long long>(UnixSeconds());
  static std::atomic<uint32_t> opened{0};  // two files of one process in one second
  std::filesystem::path path =
      dir / fmt::format("events.out.tfevents.{}.{}.{}.{}.{}", now, host, getpid(), opened.fetch_add(1), tag);
  FILE* file = std::fopen(path.c_str(), "wbx");  // x: never append to another run's file
  if (file == nullptr) return IoError("tensorboard: {}: cannot create: {}", path.string(), std::strerror(errno));
  std::unique_ptr<EventFile> events(new EventFile(std::move(path), file));
  tensorboard::Event first;
  first.set_wall_time(UnixSeconds());
  first.set_file_version("brain.Event:2");
  ESTUARY_RETURN_IF_ERROR(events->WriteRecord(first.SerializeAsString()));
  if (std::fflush(file) != 0) return IoError("tensorboard: {}: {}", events->path_.string(), std::strerror(errno));
  return events;
}

EventFile::~EventFile() { std::fclose(file_); }

Status EventFile::WriteScalars(int64_t step, const std::map<std::string, double>& values) {
  tensorboard::Event event;
  event.set_wall_time(UnixSeconds());
  event.set_step(step);
  for (const auto& [tag, value] : values) {
    tensorboard::SummaryValue* v = event.mutable_summary()->add_value();
    v->set_tag(tag);
    v->set_simple_value(static_cast<float>(value));
  }
  ESTUARY_RETURN_IF_ERROR(WriteRecord(event.SerializeAsString()));
  if (std::fflush(file_) != 0) return IoError("tensorboard: {}: {}", path_.string(), std::strerror(errno));
  return Status::Ok();
}

Status EventFile::WriteRecord(const std::string& data) {
  char header[12];
  const uint64_t length = data.size();
  for (int i = 0; i < 8; ++i) header[i] = char(length >> (8 * i));
  const uint32_t length_crc = MaskedCrc32c(std::string_view(header, 8));
  for (int i = 0; i < 4; ++i) header[8 + i] = char(length_crc >> (8 * i));
  const uint32_t data_crc = MaskedCrc32c(data);
  char footer[4];
  for (int i = 0; i < 4; ++i) footer[i] = char(data_crc >> (8 * i));
  if (std::fwrite(header, 1, sizeof header, file_) != sizeof header ||
      std::fwrite(data.data(), 1, data.size(), file_) != data.size() ||
      std::fwrite(footer, 1, sizeof footer, file_) != sizeof footer) {
    return IoError("tensorboard: {}: cannot write: {}", path_.string(), std::strerror(errno));
  }
  return Status::Ok();
}

}  // namespace estuary::proto
