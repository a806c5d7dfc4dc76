#include "base/descriptors.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <algorithm>

namespace estuary {
namespace {

rlimit Current() {
  rlimit limit{};
  EXPECT_EQ(::getrlimit(RLIMIT_NOFILE, &limit), 0);
  return limit;
}

// Puts the soft limit back as it was when the test ends.
class DescriptorsTest : public ::testing::Test {
 protected:
  void SetUp() override { saved_ = Current(); }
  void TearDown() override { ::setrlimit(RLIMIT_NOFILE, &saved_); }
  rlimit saved_{};
};

// The hard limit the test works under: the process's, or (unlimited) one it
// sets itself; a process may always lower its hard limit.
rlim_t FiniteHardLimit() {
  rlimit limit = Current();
  if (limit.rlim_max == RLIM_INFINITY) {
    limit.rlim_max = std::max<rlim_t>(limit.rlim_cur == RLIM_INFINITY ? 4096 : limit.rlim_cur, 64);
    if (limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur > limit.rlim_max) limit.rlim_cur = limit.rlim_max;
    EXPECT_EQ(::setrlimit(RLIMIT_NOFILE, &limit), 0);
  }
  return limit.rlim_max;
}

TEST_F(DescriptorsTest, RaisesTheSoftLimitUpToWhatIsNeeded) {
  const rlim_t hard = FiniteHardLimit();
  ASSERT_GE(hard, 64u);
  rlimit lowered = Current();
  lowered.rlim_cur = hard / 2;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &lowered), 0);
  ASSERT_TRUE(EnsureDescriptors(hard * 3 / 4).ok());
  EXPECT_EQ(Current().rlim_cur, hard * 3 / 4);
  EXPECT_EQ(Current().rlim_max, hard);
  // Enough already: nothing changes, and nothing is lowered.
  ASSERT_TRUE(EnsureDescriptors(hard / 4).ok());
  EXPECT_EQ(Current().rlim_cur, hard * 3 / 4);
}

TEST_F(DescriptorsTest, PastTheHardLimitItSaysSoAndChangesNothing) {
  const rlim_t hard = FiniteHardLimit();
  const rlim_t soft = Current().rlim_cur;
  const Status s = EnsureDescriptors(uint64_t(hard) + 1);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("hard limit"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find(std::to_string(hard)), std::string::npos) << s.ToString();
  EXPECT_EQ(Current().rlim_cur, soft);
}

}  // namespace
}  // namespace estuary
