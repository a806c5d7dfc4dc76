#include "secagg/shamir.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <span>
#include <vector>

namespace estuary::secagg {
namespace {

Key32 TestSecret(uint8_t first) {
  Key32 secret;
  for (size_t i = 0; i < secret.size(); ++i) secret[i] = static_cast<uint8_t>(first + 37 * i);
  return secret;
}

std::vector<uint32_t> Coordinates(int n) {
  std::vector<uint32_t> xs(n);
  for (int i = 0; i < n; ++i) xs[i] = static_cast<uint32_t>(i + 1);
  return xs;
}

// Every k-subset of [0, n), as index lists.
std::vector<std::vector<int>> Subsets(int n, int k) {
  std::vector<std::vector<int>> out;
  std::vector<bool> pick(n, false);
  std::fill(pick.begin(), pick.begin() + k, true);
  do {
    std::vector<int> subset;
    for (int i = 0; i < n; ++i) {
      if (pick[i]) subset.push_back(i);
    }
    out.push_back(subset);
  } while (std::prev_permutation(pick.begin(), pick.end()));
  return out;
}

std::vector<Share> Pick(const std::vector<Share>& shares, const std::vector<int>& indices) {
  std::vector<Share> out;
  for (int i : indices) out.push_back(shares[i]);
  return out;
}

void ExpectEverySubsetReconstructs(const std::vector<uint32_t>& xs, int t) {
  const int n = static_cast<int>(xs.size());
  const Key32 secret = TestSecret(static_cast<uint8_t>(n * 10 + t));
  auto split = Split(secret, t, xs);
  ASSERT_TRUE(split.ok()) << split.status().ToString();
  const auto subsets = Subsets(n, t);
  int reconstructed = 0;
  for (const auto& subset : subsets) {
    // Each subset in two orders: interpolation must not depend on it.
    std::vector<Share> shares = Pick(split->shares, subset);
    for (int pass = 0; pass < 2; ++pass) {
      auto combined = Combine(shares, t, split->commitment);
      ASSERT_TRUE(combined.ok()) << combined.status().ToString();
      EXPECT_EQ(*combined, secret);
      reconstructed += *combined == secret;
      std::reverse(shares.begin(), shares.end());
    }
  }
  EXPECT_EQ(reconstructed, 2 * static_cast<int>(subsets.size()));
}

TEST(Shamir, EveryThreeOfFiveReconstructs) {
  EXPECT_EQ(Subsets(5, 3).size(), 10u);
  ExpectEverySubsetReconstructs(Coordinates(5), 3);
}

TEST(Shamir, EveryFourOfSevenReconstructs) {
  EXPECT_EQ(Subsets(7, 4).size(), 35u);
  ExpectEverySubsetReconstructs(Coordinates(7), 4);
}

// Interpolation gathers the differences of coordinates in machine words:
// coordinates across the whole 32-bit range make every difference fill a
// word of its own, many of them negative.
TEST(Shamir, CoordinatesAcrossTheWholeRangeReconstruct) {
  ExpectEverySubsetReconstructs({1, 2, 0xffffffffu, 0x80000000u, 0x7fffffffu, 123456789u}, 4);
}

// A threshold of SecAgg+'s size at 10,000 sites (t = 21 of k = 40 holders,
// their ids spread over the population): all 40 shares, each beyond the
// first 21 checked against their polynomial, and three different 21.
TEST(Shamir, TwentyOneOfFortyAtTenThousandSitesReconstructs) {
  std::vector<uint32_t> xs;
  for (uint32_t i = 0; i < 40; ++i) xs.push_back(1 + (i * 2477u) % 10000u);
  const Key32 secret = TestSecret(21);
  auto split = Split(secret, 21, xs);
  ASSERT_TRUE(split.ok()) << split.status().ToString();
  auto all = Combine(split->shares, 21, split->commitment);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  EXPECT_EQ(*all, secret);
  for (size_t start : {size_t{0}, size_t{7}, size_t{19}}) {
    const auto some = std::span(split->shares).subspan(start, 21);
    auto combined = Combine(some, 21, split->commitment);
    ASSERT_TRUE(combined.ok()) << combined.status().ToString();
    EXPECT_EQ(*combined, secret) << "shares " << start << " to " << start + 20;
  }
}

TEST(Shamir, MoreThanThresholdReconstructsAndAllSharesAgree) {
  const Key32 secret = TestSecret(9);
  auto split = Split(secret, 3, Coordinates(7));
  ASSERT_TRUE(split.ok());
  auto combined = Combine(split->shares, 3, split->commitment);
  ASSERT_TRUE(combined.ok()) << combined.status().ToString();
  EXPECT_EQ(*combined, secret);
}

TEST(Shamir, ExtremeSecretsRoundTrip) {
  for (uint8_t fill : {uint8_t{0x00}, uint8_t{0xff}}) {
    Key32 secret;
    secret.fill(fill);
    auto split = Split(secret, 2, Coordinates(3));
    ASSERT_TRUE(split.ok());
    auto combined = Combine(std::span(split->shares).subspan(1), 2, split->commitment);
    ASSERT_TRUE(combined.ok()) << combined.status().ToString();
    EXPECT_EQ(*combined, secret);
  }
}

TEST(Shamir, SharesAreFreshRandomnessEachSplit) {
  const Key32 secret = TestSecret(1);
  auto a = Split(secret, 3, Coordinates(5));
  auto b = Split(secret, 3, Coordinates(5));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->shares[0].y, b->shares[0].y);
  EXPECT_EQ(a->commitment, b->commitment);
}

TEST(Shamir, BelowThresholdIsRefusedAndInterpolatesToSomethingElse) {
  const Key32 secret = TestSecret(2);
  for (auto [n, t] : {std::pair{5, 3}, std::pair{7, 4}}) {
    auto split = Split(secret, t, Coordinates(n));
    ASSERT_TRUE(split.ok());
    for (const auto& subset : Subsets(n, t - 1)) {
      const std::vector<Share> few = Pick(split->shares, subset);
      auto combined = Combine(few, t, split->commitment);
      ASSERT_FALSE(combined.ok());
      EXPECT_EQ(combined.status().code(), Code::kFailedPrecondition);
      // Interpolating the t − 1 points anyway gives the constant term of a
      // lower-degree polynomial, not the secret.
      auto raw = InterpolateAtZero(few);
      ASSERT_TRUE(raw.ok());
      std::array<uint8_t, kShareValueBytes> secret_as_element{};
      std::copy(secret.begin(), secret.end(), secret_as_element.end() - 32);
      EXPECT_NE(*raw, secret_as_element);
    }
    // Claiming a lower threshold than the split used: t − 1 shares pass the
    // count, but the value they interpolate to is refused (it is almost surely
    // wider than 256 bits; if not, the commitment would not match).
    auto lied = Combine(Pick(split->shares, Subsets(n, t - 1)[0]), t - 1, split->commitment);
    ASSERT_FALSE(lied.ok());
    EXPECT_EQ(lied.status().code(), Code::kInvalidArgument) << lied.status().ToString();
  }
}

TEST(Shamir, TamperedShareIsDetected) {
  const Key32 secret = TestSecret(3);
  auto split = Split(secret, 3, Coordinates(5));
  ASSERT_TRUE(split.ok());
  for (size_t victim = 0; victim < 3; ++victim) {
    for (size_t byte : {size_t{0}, size_t{40}, kShareValueBytes - 1}) {
      std::vector<Share> shares = split->shares;
      shares[victim].y[byte] ^= 0x01;
      // Exactly t shares: the commitment (or the field bound) catches it.
      auto exact = Combine(std::span(shares).first(3), 3, split->commitment);
      EXPECT_FALSE(exact.ok()) << "victim " << victim << " byte " << byte;
      // All five: the extra shares do not lie on the first three's polynomial.
      auto all = Combine(shares, 3, split->commitment);
      EXPECT_FALSE(all.ok());
    }
  }
  // A changed x is a different point: refused the same way.
  std::vector<Share> moved = split->shares;
  moved[0].x = 6;
  EXPECT_FALSE(Combine(std::span(moved).first(3), 3, split->commitment).ok());
  // A share of another secret's polynomial mixed in.
  auto other = Split(TestSecret(4), 3, Coordinates(5));
  ASSERT_TRUE(other.ok());
  std::vector<Share> mixed = {split->shares[0], split->shares[1], other->shares[2]};
  EXPECT_FALSE(Combine(mixed, 3, split->commitment).ok());
  // The honest shares against another secret's commitment.
  EXPECT_FALSE(Combine(split->shares, 3, other->commitment).ok());
}

TEST(Shamir, BadInputsAreRefusedInOneLine) {
  const Key32 secret = TestSecret(5);
  const std::vector<uint32_t> with_zero = {1, 0, 3};
  const std::vector<uint32_t> with_duplicate = {1, 2, 2};
  const std::vector<Status> refusals = {
      Split(secret, 2, with_zero).status(),
      Split(secret, 2, with_duplicate).status(),
      Split(secret, 0, Coordinates(3)).status(),
      Split(secret, 4, Coordinates(3)).status(),
  };
  for (const Status& status : refusals) {
    ASSERT_FALSE(status.ok());
    EXPECT_EQ(status.code(), Code::kInvalidArgument);
    EXPECT_EQ(status.message().find('\n'), std::string::npos);
    EXPECT_EQ(status.message().rfind("secagg: shamir: ", 0), 0u) << status.message();
  }
  EXPECT_NE(refusals[0].message().find("x = 0"), std::string::npos);
  EXPECT_NE(refusals[1].message().find("x = 2 appears twice"), std::string::npos);

  auto split = Split(secret, 2, Coordinates(3));
  ASSERT_TRUE(split.ok());
  std::vector<Share> duplicate = {split->shares[0], split->shares[0]};
  auto refused = Combine(duplicate, 2, split->commitment);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("appears twice"), std::string::npos);
  std::vector<Share> zero = {split->shares[0], split->shares[1]};
  zero[1].x = 0;
  EXPECT_FALSE(Combine(zero, 2, split->commitment).ok());
  std::vector<Share> out_of_field = {split->shares[0], split->shares[1]};
  out_of_field[1].y.fill(0xff);
  auto too_big = Combine(out_of_field, 2, split->commitment);
  ASSERT_FALSE(too_big.ok());
  EXPECT_NE(too_big.status().message().find("not a field element"), std::string::npos);
}

}  // namespace
}  // namespace estuary::secagg
