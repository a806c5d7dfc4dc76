#include <gtest/gtest.h>

#include <signal.h>
#include <sys/resource.h>

#include <numeric>

#include "crypto/sha256.h"
#include "crypto/transfer_digest.h"
#include "server/staging.h"

namespace estuary::server {
namespace {

Manifest Flat(uint64_t n) {
  Manifest m;
  m.tensors.push_back({"w", {int64_t(n)}, DType::kF32, 0});
  m.total_elements = n;
  return m;
}

std::string Bytes(const std::vector<float>& v, size_t begin, size_t end) {
  return std::string(reinterpret_cast<const char*>(v.data()) + begin, end - begin);
}

class StagingTest : public ::testing::TestWithParam<uint64_t> {};  // the memory budget

TEST_P(StagingTest, AssemblesChunksAndChecksTheDigest) {
  std::vector<float> values(1000);
  std::iota(values.begin(), values.end(), 0.5f);
  const std::string digest = crypto::TransferDigestHex(values.data(), values.size() * 4);
  auto staged = StagedUpdate::Create(Flat(1000), GetParam(), std::filesystem::temp_directory_path());
  ASSERT_TRUE(staged.ok()) << staged.status().ToString();
  EXPECT_EQ((*staged)->spilled(), GetParam() < 4000);
  ASSERT_TRUE((*staged)->Append(0, v1::DTYPE_F32, Bytes(values, 0, 1024)).ok());
  EXPECT_FALSE((*staged)->Commit(digest).ok());  // incomplete
  ASSERT_TRUE((*staged)->Append(1024, v1::DTYPE_F32, Bytes(values, 1024, 4000)).ok());
  ASSERT_TRUE((*staged)->Commit(digest).ok());
  auto span = (*staged)->values();
  ASSERT_EQ(span.size(), 1000u);
  EXPECT_TRUE(std::equal(span.begin(), span.end(), values.begin()));
}

// A wrong digest, and the right bytes' SHA-256 (what a site of protocol
// version 1 announced), are refused alike.
TEST_P(StagingTest, RefusesAWrongDigest) {
  std::vector<float> values(100, 1.0f);
  for (const std::string& announced :
       {std::string(32, '0'), crypto::Sha256Hex(values.data(), values.size() * sizeof(float))}) {
    auto staged = StagedUpdate::Create(Flat(100), GetParam(), std::filesystem::temp_directory_path());
    ASSERT_TRUE(staged.ok());
    ASSERT_TRUE((*staged)->Append(0, v1::DTYPE_F32, Bytes(values, 0, 400)).ok());
    auto committed = (*staged)->Commit(announced);
    ASSERT_FALSE(committed.ok()) << announced;
    EXPECT_NE(committed.message().find("does not match"), std::string::npos) << committed.message();
  }
}

TEST_P(StagingTest, RefusesOutOfOrderChunks) {
  std::vector<float> values(100, 1.0f);
  auto staged = StagedUpdate::Create(Flat(100), GetParam(), std::filesystem::temp_directory_path());
  ASSERT_TRUE(staged.ok());
  EXPECT_FALSE((*staged)->Append(8, v1::DTYPE_F32, Bytes(values, 0, 8)).ok());
  EXPECT_EQ((*staged)->received_bytes(), 0u);
}

// A spilled payload is written to its file, not stored through a mapping: a
// write the file system refuses (here: past the process's file size limit,
// as a full disk would) is the chunk's error, and the server lives on.
TEST(SpillFile, AWriteTheFileRefusesIsTheChunksError) {
  std::vector<float> values(1000, 2.0f);
  auto staged = StagedUpdate::Create(Flat(1000), 0, std::filesystem::temp_directory_path());
  ASSERT_TRUE(staged.ok()) << staged.status().ToString();
  ASSERT_TRUE((*staged)->Append(0, v1::DTYPE_F32, Bytes(values, 0, 1024)).ok());
  rlimit before{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &before), 0);
  rlimit limited = before;
  limited.rlim_cur = 1024;
  auto* previous = signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &limited), 0);
  const Status appended = (*staged)->Append(1024, v1::DTYPE_F32, Bytes(values, 1024, 4000));
  setrlimit(RLIMIT_FSIZE, &before);
  signal(SIGXFSZ, previous);
  ASSERT_FALSE(appended.ok());
  EXPECT_NE(appended.message().find("cannot write the spill file"), std::string::npos) << appended.message();
  EXPECT_EQ((*staged)->received_bytes(), 1024u);
}

INSTANTIATE_TEST_SUITE_P(MemoryAndSpillFile, StagingTest, ::testing::Values(uint64_t{1} << 20, uint64_t{0}));

}  // namespace
}  // namespace estuary::server
