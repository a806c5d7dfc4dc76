// CheckUpdateBegin: what an announced update must be before it is staged,
// and the one line a sender gets back otherwise.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "proto/wire.h"
#include "server/update_checks.h"

namespace estuary::server {
namespace {

// w [4, 8] at 0, b [8] at 32: 40 elements.
Manifest Layout() {
  Manifest m;
  m.Append("w", {4, 8});
  m.Append("b", {8});
  return m;
}

v1::UpdateBegin Announced(const Manifest& layout) {
  v1::UpdateBegin begin;
  begin.set_round(1);
  begin.set_kind(v1::UPDATE_FULL);
  begin.set_num_examples(100);
  begin.set_train_loss(0.5);
  *begin.mutable_manifest() = proto::ToProto(layout);
  return begin;
}

std::string Refusal(const v1::UpdateBegin& begin, const v1::UpdateLimits& limits = {}) {
  auto layout = CheckUpdateBegin(begin, "site-a", v1::UPDATE_FULL, limits, Layout(), std::nullopt);
  EXPECT_FALSE(layout.ok());
  return layout.ok() ? "" : layout.status().message();
}

TEST(UpdateChecks, AnUpdateOfTheGlobalLayoutPasses) {
  auto layout = CheckUpdateBegin(Announced(Layout()), "site-a", v1::UPDATE_FULL, {}, Layout(), std::nullopt);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  EXPECT_TRUE(*layout == Layout());
}

TEST(UpdateChecks, EachRefusalNamesWhatIsWrong) {
  v1::UpdateBegin begin = Announced(Layout());
  begin.set_kind(v1::UPDATE_LORA);
  EXPECT_EQ(Refusal(begin), "update kind lora from site-a, but this federation takes full");

  begin = Announced(Layout());
  begin.set_num_examples(0);
  EXPECT_EQ(Refusal(begin), "num_examples 0 out of range");
  begin.set_num_examples((uint64_t{1} << 40) + 1);
  EXPECT_EQ(Refusal(begin), "num_examples 1099511627777 out of range");

  begin = Announced(Layout());
  v1::UpdateLimits limits;
  limits.set_max_examples(1000);
  EXPECT_TRUE(CheckUpdateBegin(begin, "site-a", v1::UPDATE_FULL, limits, Layout(), std::nullopt).ok())
      << "100 examples are within 1000";
  begin.set_num_examples(1001);
  EXPECT_EQ(Refusal(begin, limits), "num_examples 1001 beyond the federation's max_examples of 1000");

  begin = Announced(Layout());
  begin.set_train_loss(std::nan(""));
  EXPECT_EQ(Refusal(begin), "train_loss nan is not finite");
  begin.set_train_loss(-1e300);
  EXPECT_EQ(Refusal(begin), "train_loss -1e+300 is not a loss (expected one in [0, 1e+06])");
  begin.set_train_loss(2e6);
  EXPECT_EQ(Refusal(begin), "train_loss 2000000 is not a loss (expected one in [0, 1e+06])");

  begin = Announced(Layout());
  begin.set_train_seconds(-1);
  EXPECT_EQ(Refusal(begin), "train_seconds -1 is not a training time");
  begin.set_train_seconds(std::numeric_limits<double>::infinity());
  EXPECT_EQ(Refusal(begin), "train_seconds inf is not a training time");

  begin = Announced(Layout());
  begin.set_local_steps(uint64_t{1} << 31);
  EXPECT_EQ(Refusal(begin), "local_steps 2147483648 is beyond 1073741824");
  begin.set_local_steps(10);
  begin.set_normalizer(-1);
  EXPECT_EQ(Refusal(begin), "normalizer -1 is not one of 10 local steps (expected one in [0, 1e4 x steps])");
  begin.set_normalizer(std::nan(""));
  EXPECT_EQ(Refusal(begin), "normalizer nan is not one of 10 local steps (expected one in [0, 1e4 x steps])");
  begin.set_normalizer(24.5);  // momentum: ‖a‖₁ beyond τ is a site's
  EXPECT_TRUE(CheckUpdateBegin(begin, "site-a", v1::UPDATE_FULL, {}, Layout(), std::nullopt).ok());

  Manifest renamed = Layout();
  renamed.tensors[1].name = "bias";
  EXPECT_EQ(Refusal(Announced(renamed)), "update manifest does not match the global model's");

  Manifest larger = Layout();
  larger.tensors[1].shape = {9};
  larger.total_elements = 41;
  const std::string too_large = Refusal(Announced(larger));
  EXPECT_FALSE(too_large.empty());
  EXPECT_EQ(too_large.find('\n'), std::string::npos);
}

// SCAFFOLD: the upload stages Δc_i after the delta, in the same area, so the
// staging budget counts both; an announcement whose control_follows is not
// what the strategy takes is refused in one line naming the site.
TEST(UpdateChecks, AScaffoldUploadStagesItsControlDeltaAfterTheDelta) {
  v1::UpdateBegin begin = Announced(Layout());
  auto plain = StagedLayout(begin, "site-a", Layout(), false);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(*plain, Layout());
  auto missing = StagedLayout(begin, "site-a", Layout(), true);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("update from site-a carries no control delta: strategy scaffold"),
            std::string::npos)
      << missing.status().message();
  begin.set_control_follows(true);
  auto staged = StagedLayout(begin, "site-a", Layout(), true);
  ASSERT_TRUE(staged.ok()) << staged.status().ToString();
  EXPECT_EQ(staged->total_elements, 80u);
  EXPECT_EQ(staged->byte_size(), 2 * Layout().byte_size());
  ASSERT_EQ(staged->tensors.size(), 3u);
  EXPECT_EQ(staged->tensors[2].name, "scaffold.control_delta");
  EXPECT_EQ(staged->tensors[2].offset, 40u);
  auto unwanted = StagedLayout(begin, "site-a", Layout(), false);
  ASSERT_FALSE(unwanted.ok());
  EXPECT_NE(unwanted.status().message().find("carries a control delta, but this federation's strategy is not "
                                             "scaffold"),
            std::string::npos)
      << unwanted.status().message();
}

}  // namespace
}  // namespace estuary::server
