// TensorBoard event files (proto/event_file.h) read back by an independent
// reader (read_tfevents.py: the TFRecord framing and protobuf wire format
// decoded by hand in Python, with its own CRC32C): every step and scalar as
// written, float32-rounded.
#include "proto/event_file.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <utility>

namespace estuary::proto {
namespace {

// read_tfevents.py on `file`: its exit status and what it printed.
std::pair<int, std::string> ReadBack(const std::filesystem::path& file) {
  const std::string command =
      fmt::format("{} {}/read_tfevents.py {} 2>&1", ESTUARY_PYTHON, ESTUARY_TEST_DIR, file.string());
  std::string out;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return {-1, "cannot run " + command};
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) out.append(buffer, n);
  return {pclose(pipe), out};
}

TEST(EventFile, Crc32cHasItsCheckValue) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(""), 0u);
}

TEST(EventFile, AnIndependentReaderReadsEveryScalarBack) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / fmt::format("estuary-tb-{}", getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::path path;
  {
    auto events = EventFile::Create(dir / "run", "test");
    ASSERT_TRUE(events.ok()) << events.status().ToString();
    path = (*events)->path();
    EXPECT_NE(path.filename().string().find("tfevents"), std::string::npos);
    for (int64_t round = 1; round <= 3; ++round) {
      ASSERT_TRUE((*events)->WriteScalars(round, {{"round/test_accuracy", 0.5 + 0.1 * double(round)},
                                                  {"round/train_loss", 2.0 / double(round)},
                                                  {"round/bytes_up", 1e9 * double(round)}})
                      .ok());
    }
  }
  const auto [status, output] = ReadBack(path);
  ASSERT_EQ(status, 0) << output;
  auto doc = nlohmann::json::parse(output, nullptr, false);
  ASSERT_FALSE(doc.is_discarded()) << output;
  EXPECT_EQ(doc["file_version"], "brain.Event:2");
  ASSERT_EQ(doc["events"].size(), 3u);
  for (int64_t round = 1; round <= 3; ++round) {
    const auto& event = doc["events"][round - 1];
    EXPECT_EQ(event["step"], round);
    EXPECT_GT(event["wall_time"].get<double>(), 1.7e9);
    EXPECT_EQ(event["scalars"]["round/test_accuracy"].get<double>(), double(float(0.5 + 0.1 * double(round))));
    EXPECT_EQ(event["scalars"]["round/train_loss"].get<double>(), double(float(2.0 / double(round))));
    EXPECT_EQ(event["scalars"]["round/bytes_up"].get<double>(), double(float(1e9 * double(round))));
  }
  // A second run in the same directory gets a file of its own.
  auto again = EventFile::Create(dir / "run", "test");
  ASSERT_TRUE(again.ok());
  EXPECT_NE((*again)->path(), path);
  std::filesystem::remove_all(dir);
}

TEST(EventFile, ACorruptedRecordIsRefusedByTheReader) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / fmt::format("estuary-tb-bad-{}", getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::path path;
  {
    auto events = EventFile::Create(dir, "test");
    ASSERT_TRUE(events.ok());
    path = (*events)->path();
    ASSERT_TRUE((*events)->WriteScalars(1, {{"a", 1.0}}).ok());
  }
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  file.seekp(-6, std::ios::end);  // inside the last record's data
  file.put('\x7f');
  file.close();
  const auto [status, output] = ReadBack(path);
  EXPECT_NE(status, 0) << "the reader took a corrupted record";
  EXPECT_NE(output.find("CRC does not match"), std::string::npos) << output;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace estuary::proto
