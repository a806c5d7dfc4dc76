#include <gtest/gtest.h>

#include <numeric>

#include "crypto/sha256.h"
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

TEST_P(StagingTest, AssemblesChunksAndChecksTheChecksum) {
  std::vector<float> values(1000);
  std::iota(values.begin(), values.end(), 0.5f);
  const std::string sha = crypto::Sha256Hex(values.data(), values.size() * 4);
  auto staged = StagedUpdate::Create(Flat(1000), GetParam(), std::filesystem::temp_directory_path());
  ASSERT_TRUE(staged.ok()) << staged.status().ToString();
  EXPECT_EQ((*staged)->spilled(), GetParam() < 4000);
  ASSERT_TRUE((*staged)->Append(0, v1::DTYPE_F32, Bytes(values, 0, 1024)).ok());
  EXPECT_FALSE((*staged)->Commit(sha).ok());  // incomplete
  ASSERT_TRUE((*staged)->Append(1024, v1::DTYPE_F32, Bytes(values, 1024, 4000)).ok());
  ASSERT_TRUE((*staged)->Commit(sha).ok());
  auto span = (*staged)->values();
  ASSERT_EQ(span.size(), 1000u);
  EXPECT_TRUE(std::equal(span.begin(), span.end(), values.begin()));
}

TEST_P(StagingTest, RefusesAWrongChecksum) {
  std::vector<float> values(100, 1.0f);
  auto staged = StagedUpdate::Create(Flat(100), GetParam(), std::filesystem::temp_directory_path());
  ASSERT_TRUE(staged.ok());
  ASSERT_TRUE((*staged)->Append(0, v1::DTYPE_F32, Bytes(values, 0, 400)).ok());
  auto committed = (*staged)->Commit(std::string(64, '0'));
  ASSERT_FALSE(committed.ok());
  EXPECT_NE(committed.message().find("does not match"), std::string::npos);
}

TEST_P(StagingTest, RefusesOutOfOrderChunks) {
  std::vector<float> values(100, 1.0f);
  auto staged = StagedUpdate::Create(Flat(100), GetParam(), std::filesystem::temp_directory_path());
  ASSERT_TRUE(staged.ok());
  EXPECT_FALSE((*staged)->Append(8, v1::DTYPE_F32, Bytes(values, 0, 8)).ok());
  EXPECT_EQ((*staged)->received_bytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(MemoryAndSpillFile, StagingTest, ::testing::Values(uint64_t{1} << 20, uint64_t{0}));

}  // namespace
}  // namespace estuary::server
