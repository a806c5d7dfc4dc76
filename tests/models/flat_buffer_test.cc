// FlatBuffer and the page helpers ZeRO-2/3 use to give back the memory of
// released ranges (models/flat_buffer.h).
#include "models/flat_buffer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <span>

namespace estuary::models {
namespace {

// ZeRO-2/3 return released ranges' pages to the OS and measure what stays.
TEST(FlatBuffer, ReleasesWholePagesAndMeasuresResidentBytes) {
  const size_t page = PageSize(), floats_per_page = page / sizeof(float);
  FlatBuffer<float> buffer(64 * floats_per_page);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % page, 0u);
  std::span<float> all(buffer);
  EXPECT_EQ(*ResidentBytes(all), 0u) << "fresh pages cost nothing until written";
  EXPECT_EQ(buffer[12345], 0.0f);  // and read as zeros (this touches one page)
  std::fill(all.begin(), all.end(), 1.0f);
  EXPECT_EQ(*ResidentBytes(all), all.size_bytes());

  // A range that starts and ends mid-page: only the 10 pages wholly inside go.
  const size_t begin = 3 * floats_per_page + 100, end = 14 * floats_per_page + 7;
  std::span<float> range = all.subspan(begin, end - begin);
  EXPECT_EQ(*ReleasePages(range), 10 * page);
  EXPECT_EQ(*ResidentBytes(all), all.size_bytes() - 10 * page);
  EXPECT_EQ(*ResidentBytes(range), range.size_bytes() - 10 * page);  // the two partial end pages stay
  EXPECT_EQ(*ResidentBytes(all.subspan(4 * floats_per_page, 10 * floats_per_page)), 0u);
  for (size_t i = 0; i < all.size(); ++i) {
    const bool released = i >= 4 * floats_per_page && i < 14 * floats_per_page;
    ASSERT_EQ(all[i], released ? 0.0f : 1.0f) << "element " << i;  // neighbours keep their values
  }
  // The reads above brought the released pages back as zero pages; writing
  // makes them resident again.
  std::fill(range.begin(), range.end(), 2.0f);
  EXPECT_EQ(*ResidentBytes(all), all.size_bytes());

  // Less than a page inside the range: nothing is released.
  EXPECT_EQ(*ReleasePages(all.subspan(floats_per_page + 1, floats_per_page)), 0u);
  EXPECT_EQ(*ResidentBytes(all), all.size_bytes());
  EXPECT_EQ(*ReleasePages(all.subspan(0, 0)), 0u);
  EXPECT_EQ(*ResidentBytes(all.subspan(0, 0)), 0u);

  // Moving keeps the memory where it is.
  float* data = buffer.data();
  FlatBuffer<float> moved(std::move(buffer));
  EXPECT_EQ(moved.data(), data);
  EXPECT_EQ(buffer.data(), nullptr);
}

}  // namespace
}  // namespace estuary::models
