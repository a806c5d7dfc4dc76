// ModelDistribution: which site downloads what of the global model, two at a
// time, checked through what the sites would receive; a download that holds
// its place too long gives it up; a site holds a version once it confirms it.
#include <gtest/gtest.h>

#include <cctype>
#include <numeric>
#include <string>
#include <vector>

#include "crypto/sha256.h"
#include "crypto/transfer_digest.h"
#include "proto/model_patch.h"
#include "server/distribution.h"
#include "tests/server/fakes.h"

namespace estuary::server {
namespace {

using fake::FakeClock;
using fake::FakeSession;
using std::chrono::seconds;

// a [4, 6] at 0, w [16, 32] at 24, w2 [16, 32] at 536, b [8] at 1048: 1056 elements.
Manifest Layout() {
  Manifest m;
  m.Append("a", {4, 6});
  m.Append("w", {16, 32});
  m.Append("w2", {16, 32});
  m.Append("b", {8});
  return m;
}

GlobalModel ModelOf(std::vector<float> values, uint64_t version) {
  const size_t bytes = values.size() * sizeof(float);
  const std::string checksum = crypto::Sha256Hex(values.data(), bytes);
  const std::string digest = crypto::TransferDigestHex(values.data(), bytes);
  return {std::make_shared<const std::vector<float>>(std::move(values)), checksum, version, digest};
}

v1::Hello Holding(const GlobalModel& model, bool keeps_model) {
  v1::Hello hello;
  hello.set_model_version_held(model.version);
  hello.set_model_checksum_held(model.checksum);
  hello.set_keeps_model(keeps_model);
  return hello;
}

class DistributionTest : public ::testing::Test {
 protected:
  DistributionTest() {
    std::vector<float> values(Layout().total_elements);
    std::iota(values.begin(), values.end(), 0.0f);
    v0 = ModelOf(values, 0);
    distribution.Reset(Layout(), v0);
    // Round 1 changes w and b densely, and w2 by a rank-2 product.
    for (uint64_t i = 24; i < 536; ++i) values[i] += 1;
    for (uint64_t i = 1048; i < 1056; ++i) values[i] -= 1;
    for (uint64_t i = 536; i < 1048; ++i) values[i] *= 2;
    v1 = ModelOf(values, 1);
    change.offset = 536;
    change.delta = {.rows = 16, .cols = 32, .rank = 2, .u = std::vector<float>(32, 0.5f),
                    .v = std::vector<float>(64, 0.25f)};
  }

  std::shared_ptr<FakeSession> Site(const std::string& name, const v1::Hello& hello) {
    auto session = std::make_shared<FakeSession>(name);
    distribution.OnHello(name, hello);
    return session;
  }

  FakeClock clock;
  ModelDistribution distribution{clock, seconds(30)};
  GlobalModel v0, v1;
  aggregation::LowRankChange change;
};

TEST_F(DistributionTest, APatchOnlyForASiteThatKeptExactlyThePreviousVersion) {
  auto keeper = Site("keeper", Holding(v0, true));
  auto forgetful = Site("forgetful", Holding(v0, false));
  GlobalModel other = v0;
  other.checksum = std::string(64, '0');
  auto diverged = Site("diverged", Holding(other, true));
  auto fresh = Site("fresh", v1::Hello());
  distribution.Publish(v1, {change});
  auto current = Site("current", Holding(v1, true));
  distribution.BeginRound(2);

  const uint64_t whole = Layout().byte_size();
  v1::RoundStart start;
  start.set_round(2);
  EXPECT_EQ(distribution.Offer(keeper, &start), (512 + 8 + 2 * (16 + 32)) * sizeof(float));
  EXPECT_TRUE(start.model_follows());
  EXPECT_EQ(start.model_digest(), v1.digest) << "a patch is checked over the whole model it makes";
  EXPECT_EQ(start.patch_base_version(), 0u);
  auto patch = proto::ReadModelPatch(start, Layout());
  ASSERT_TRUE(patch.ok()) << patch.status().ToString();
  EXPECT_EQ(patch->ranges, (std::vector<std::pair<uint64_t, uint64_t>>{{24, 512}, {1048, 8}}));
  EXPECT_EQ(patch->low_rank, (std::vector<proto::LowRankPatch>{{.offset = 536, .rows = 16, .cols = 32, .rank = 2}}));

  for (const auto& site : {forgetful, diverged, fresh}) {
    EXPECT_EQ(distribution.Offer(site, &start), whole) << site->name();
    EXPECT_TRUE(start.model_follows());
    EXPECT_EQ(start.model_digest(), v1.digest) << site->name();
    EXPECT_EQ(start.patch_size() + start.low_rank_size(), 0) << site->name();
    EXPECT_EQ(start.patch_base_version(), 0u);
  }
  EXPECT_EQ(distribution.Offer(current, &start), 0u);
  EXPECT_FALSE(start.model_follows());
  EXPECT_TRUE(start.model_digest().empty());
  EXPECT_EQ(start.patch_size() + start.low_rank_size(), 0);

  // Two streams at a time, in the order offered; none for the current holder.
  distribution.StreamQueued();
  ASSERT_EQ(keeper->models.size(), 1u);
  ASSERT_EQ(forgetful->models.size(), 1u);
  EXPECT_TRUE(diverged->models.empty());
  EXPECT_EQ(keeper->models[0].round, 2u);
  EXPECT_EQ(keeper->models[0].model, v1.values) << "shared, not copied";
  EXPECT_EQ(keeper->models[0].ranges, patch->ByteRanges(1056));
  ASSERT_TRUE(keeper->models[0].tail);
  std::vector<float> factors(32, 0.5f);
  factors.insert(factors.end(), 64, 0.25f);
  EXPECT_EQ(*keeper->models[0].tail, factors) << "u, then v";
  EXPECT_TRUE(forgetful->models[0].ranges.empty()) << "the whole model";
  EXPECT_FALSE(forgetful->models[0].tail);

  keeper->FinishDownload();
  EXPECT_EQ(diverged->models.size(), 1u);
  EXPECT_TRUE(fresh->models.empty());
  forgetful->Close();  // a closed session frees its stream too
  EXPECT_EQ(fresh->models.size(), 1u);
  EXPECT_TRUE(current->models.empty());

  // A download written is no proof: until a site confirms (its
  // UpdateBegin), the next attempt sends the model again.
  distribution.BeginRound(2);
  for (const auto& site : {keeper, forgetful, diverged, fresh}) {
    EXPECT_GT(distribution.Offer(site, &start), 0u) << site->name();
    EXPECT_TRUE(start.model_follows()) << site->name();
  }
  EXPECT_EQ(distribution.Offer(current, &start), 0u) << "its Hello said it holds version 1";
  for (const auto& site : {keeper, forgetful, diverged, fresh, current}) distribution.Confirm(site->name());

  // Confirmed: those that keep their models hold version 1, the one that
  // does not holds nothing.
  distribution.BeginRound(3);
  for (const auto& site : {keeper, diverged, current}) {
    EXPECT_EQ(distribution.Offer(site, &start), 0u) << site->name();
    EXPECT_FALSE(start.model_follows());
  }
  for (const auto& site : {forgetful, fresh}) {
    EXPECT_EQ(distribution.Offer(site, &start), whole) << site->name();
    EXPECT_TRUE(start.model_follows());
  }
}

// A federation on a Hugging Face base: every site holds the base (here a, w
// and w2 as in v0, with b, the adapter's stand-in, zero). A site that holds
// no version is sent what differs from that, never the whole model; a site
// that kept the previous version gets the usual patch where it is smaller.
TEST(HeldBaseDistribution, ASiteWithoutAVersionGetsWhatDiffersFromTheBaseItHolds) {
  FakeClock clock;
  ModelDistribution distribution{clock, seconds(30)};
  std::vector<float> values(Layout().total_elements);
  std::iota(values.begin(), values.end(), 1.0f);
  auto held = std::make_shared<std::vector<float>>(values);
  std::fill(held->begin() + 1048, held->end(), 0.0f);
  distribution.SetHeldBase(held);
  const GlobalModel v0 = ModelOf(values, 0);
  distribution.Reset(Layout(), v0);
  auto site = [&](const std::string& name, const v1::Hello& hello) {
    distribution.OnHello(name, hello);
    return std::make_shared<FakeSession>(name);
  };
  auto first = site("first", v1::Hello());
  distribution.BeginRound(1);
  v1::RoundStart start;
  start.set_round(1);
  EXPECT_EQ(distribution.Offer(first, &start), 8 * sizeof(float));
  EXPECT_TRUE(start.model_follows());
  EXPECT_TRUE(start.patch_on_base());
  EXPECT_EQ(start.patch_base_version(), 0u);
  auto patch = proto::ReadModelPatch(start, Layout());
  ASSERT_TRUE(patch.ok()) << patch.status().ToString();
  EXPECT_EQ(patch->ranges, (std::vector<std::pair<uint64_t, uint64_t>>{{1048, 8}}));
  distribution.StreamQueued();
  ASSERT_EQ(first->models.size(), 1u);
  EXPECT_EQ(first->models[0].ranges, (std::vector<std::pair<uint64_t, uint64_t>>{{1048 * 4, 1056 * 4}}));

  // Round 1 changes w densely, w2 by a rank-2 product and b (an exact merge's residuals and the adapter).
  for (uint64_t i = 24; i < 536; ++i) values[i] += 1;
  for (uint64_t i = 536; i < 1048; ++i) values[i] *= 2;
  for (uint64_t i = 1048; i < 1056; ++i) values[i] -= 1;
  aggregation::LowRankChange change;
  change.offset = 536;
  change.delta = {.rows = 16, .cols = 32, .rank = 2, .u = std::vector<float>(32, 0.5f),
                  .v = std::vector<float>(64, 0.25f)};
  distribution.Publish(ModelOf(values, 1), {change});
  auto keeper = site("keeper", Holding(v0, true));
  auto forgetful = site("forgetful", Holding(v0, false));
  auto fresh = site("fresh", v1::Hello());
  distribution.BeginRound(2);
  start.set_round(2);
  EXPECT_EQ(distribution.Offer(keeper, &start), (512 + 8 + 2 * (16 + 32)) * sizeof(float));
  EXPECT_FALSE(start.patch_on_base());
  EXPECT_EQ(start.low_rank_size(), 1);
  for (const auto& s : {forgetful, fresh}) {
    // Every tensor that differs from the base, whole: w, w2 and b, never a.
    EXPECT_EQ(distribution.Offer(s, &start), (512 + 512 + 8) * sizeof(float)) << s->name();
    EXPECT_TRUE(start.patch_on_base()) << s->name();
    auto on_base = proto::ReadModelPatch(start, Layout());
    ASSERT_TRUE(on_base.ok());
    EXPECT_EQ(on_base->ranges, (std::vector<std::pair<uint64_t, uint64_t>>{{24, 1032}}));
    EXPECT_TRUE(on_base->low_rank.empty());
  }
}

// A full federation on a Hugging Face base: in round 1 the global model is
// the base, so a site is sent one tensor, the smallest (an empty patch would
// read as the whole model); once a round has changed every weight, the patch
// on the base is every tensor: the model, once, and nothing of the base
// beside it.
TEST(HeldBaseDistribution, AFullFederationSendsTheSmallestTensorOfTheBaseThenWhatARoundChanged) {
  FakeClock clock;
  ModelDistribution distribution{clock, seconds(30)};
  Manifest layout;
  layout.Append("embed", {16, 32});
  layout.Append("norm", {4});
  layout.Append("head", {16, 32});
  std::vector<float> values(layout.total_elements);
  std::iota(values.begin(), values.end(), 1.0f);
  distribution.SetHeldBase(std::make_shared<const std::vector<float>>(values));
  distribution.Reset(layout, ModelOf(values, 0));
  distribution.OnHello("site", v1::Hello());
  auto site = std::make_shared<FakeSession>("site");
  distribution.BeginRound(1);
  v1::RoundStart start;
  EXPECT_EQ(distribution.Offer(site, &start), 4 * sizeof(float));
  EXPECT_TRUE(start.patch_on_base());
  auto patch = proto::ReadModelPatch(start, layout);
  ASSERT_TRUE(patch.ok()) << patch.status().ToString();
  EXPECT_EQ(patch->ranges, (std::vector<std::pair<uint64_t, uint64_t>>{{512, 4}}));

  for (float& v : values) v -= 0.5f;
  distribution.Publish(ModelOf(values, 1), {});
  distribution.BeginRound(2);
  EXPECT_EQ(distribution.Offer(site, &start), layout.byte_size());
  EXPECT_TRUE(start.patch_on_base());
  patch = proto::ReadModelPatch(start, layout);
  ASSERT_TRUE(patch.ok()) << patch.status().ToString();
  EXPECT_EQ(patch->ranges, (std::vector<std::pair<uint64_t, uint64_t>>{{0, layout.total_elements}}));
}

TEST_F(DistributionTest, AConfirmationCountsOnlyForTheAttemptThatOfferedIt) {
  auto keeper = Site("keeper", Holding(v0, true));
  distribution.Publish(v1, {});
  distribution.BeginRound(2);
  v1::RoundStart start;
  distribution.Offer(keeper, &start);
  distribution.BeginRound(2);  // retried before the site confirmed
  distribution.Confirm("keeper");
  distribution.BeginRound(2);
  distribution.Offer(keeper, &start);
  EXPECT_TRUE(start.model_follows()) << "a confirmation for no offer of this attempt holds nothing";
}

// Two sites that read nothing were offered first: after the place timeout
// the next downloads start beside them, and a stalled download's end (its
// session cut off) frees no second place.
TEST_F(DistributionTest, ADownloadThatHoldsItsPlaceTooLongLetsTheNextStart) {
  std::vector<std::shared_ptr<FakeSession>> sites;
  for (const char* name : {"stalled-1", "stalled-2", "honest-1", "honest-2", "honest-3"}) {
    sites.push_back(Site(name, v1::Hello()));
  }
  distribution.BeginRound(1);
  v1::RoundStart start;
  for (const auto& site : sites) distribution.Offer(site, &start);
  distribution.StreamQueued();
  EXPECT_EQ(sites[0]->models.size() + sites[1]->models.size(), 2u);
  EXPECT_TRUE(sites[2]->models.empty());

  clock.Advance(seconds(29));
  EXPECT_TRUE(sites[2]->models.empty()) << "not before the timeout";
  clock.Advance(seconds(1));
  EXPECT_EQ(sites[2]->models.size(), 1u);
  EXPECT_EQ(sites[3]->models.size(), 1u);
  EXPECT_TRUE(sites[4]->models.empty());
  EXPECT_EQ(distribution.streaming(), 2u);

  sites[0]->Close();  // cut off by its write deadline: it held no place any more
  EXPECT_TRUE(sites[4]->models.empty());
  sites[2]->FinishDownload();
  EXPECT_EQ(sites[4]->models.size(), 1u);
  sites[3]->FinishDownload();
  sites[4]->FinishDownload();
  EXPECT_EQ(distribution.streaming(), 0u);
  EXPECT_EQ(clock.armed(), 0u) << "a finished download's timer goes with it";
}

TEST_F(DistributionTest, AModelThatChangedEverywhereGoesWhole) {
  auto keeper = Site("keeper", Holding(v0, true));
  std::vector<float> values = *v0.values;
  for (float& x : values) x += 1;
  distribution.Publish(ModelOf(values, 1), {});
  EXPECT_TRUE(distribution.patch().empty());
  distribution.BeginRound(2);
  v1::RoundStart start;
  EXPECT_EQ(distribution.Offer(keeper, &start), Layout().byte_size());
  EXPECT_TRUE(start.model_follows());
  EXPECT_EQ(start.patch_size(), 0);
}

// A site that writes the checksum it holds in upper case holds the same
// model: it is sent nothing, or only the patch (it used to get the whole
// model again).
TEST_F(DistributionTest, AHeldChecksumInUpperCaseIsTheSameChecksum) {
  auto upper = [](GlobalModel model) {
    for (char& c : model.checksum) c = char(std::toupper(static_cast<unsigned char>(c)));
    return model;
  };
  auto keeper = Site("keeper", Holding(upper(v0), true));
  distribution.Publish(v1, {change});
  auto current = Site("current", Holding(upper(v1), true));
  distribution.BeginRound(2);
  v1::RoundStart start;
  EXPECT_EQ(distribution.Offer(current, &start), 0u);
  EXPECT_FALSE(start.model_follows());
  EXPECT_LT(distribution.Offer(keeper, &start), Layout().byte_size()) << "a patch on the version it holds";
  EXPECT_TRUE(start.model_follows());
  EXPECT_EQ(start.patch_base_version(), 0u);
  EXPECT_GT(start.patch_size(), 0);
}

// SCAFFOLD: every site of a training round downloads c after the model, in
// a range of its own past the model's end, whatever of the model it holds;
// an evaluation round sends the model alone. The RoundStart names c's
// checksum.
TEST_F(DistributionTest, UnderScaffoldEveryTrainingSiteDownloadsCAfterTheModel) {
  auto fresh = Site("fresh", v1::Hello());
  auto current = Site("current", Holding(v0, true));
  std::vector<float> c(Layout().total_elements);
  std::iota(c.begin(), c.end(), -100.0f);
  auto control = std::make_shared<const std::vector<float>>(c);
  distribution.SetControl(control);
  distribution.BeginRound(1);
  const uint64_t whole = Layout().byte_size();
  v1::RoundStart start;
  start.set_round(1);
  EXPECT_EQ(distribution.Offer(fresh, &start), 2 * whole);
  EXPECT_TRUE(start.model_follows());
  EXPECT_TRUE(start.control_follows());
  EXPECT_EQ(start.control_digest(), crypto::TransferDigestHex(c.data(), whole));
  EXPECT_EQ(distribution.Offer(current, &start), whole) << "it holds the model: c alone";
  EXPECT_FALSE(start.model_follows());
  EXPECT_TRUE(start.control_follows());
  distribution.StreamQueued();
  ASSERT_EQ(fresh->models.size(), 1u);
  ASSERT_EQ(current->models.size(), 1u);
  EXPECT_EQ(fresh->models[0].ranges, (std::vector<std::pair<uint64_t, uint64_t>>{{0, whole}, {whole, 2 * whole}}));
  EXPECT_EQ(fresh->models[0].tail, control) << "shared, not copied";
  EXPECT_EQ(current->models[0].ranges, (std::vector<std::pair<uint64_t, uint64_t>>{{whole, 2 * whole}}));
  EXPECT_EQ(current->models[0].tail, control);

  distribution.BeginRound(1);
  v1::RoundStart evaluate;
  evaluate.set_evaluate_only(true);
  EXPECT_EQ(distribution.Offer(current, &evaluate), 0u);
  EXPECT_FALSE(evaluate.control_follows());
  EXPECT_EQ(distribution.Offer(fresh, &evaluate), whole);
  EXPECT_FALSE(evaluate.control_follows());
  EXPECT_TRUE(evaluate.control_digest().empty());

  distribution.SetControl(nullptr);  // another strategy: nothing past the model
  distribution.BeginRound(2);
  EXPECT_EQ(distribution.Offer(current, &start), 0u);
  EXPECT_FALSE(start.control_follows());
}

TEST_F(DistributionTest, ARetriedRoundForgetsTheStreamsOfTheAttemptBefore) {
  auto a = Site("a", v1::Hello());
  auto b = Site("b", v1::Hello());
  auto c = Site("c", v1::Hello());
  distribution.BeginRound(1);
  v1::RoundStart start;
  for (const auto& site : {a, b}) distribution.Offer(site, &start);
  distribution.StreamQueued();
  // The round failed and starts again; c never held the model, a and b now do.
  distribution.BeginRound(1);
  distribution.Offer(c, &start);
  distribution.StreamQueued();
  ASSERT_EQ(c->models.size(), 1u) << "the first attempt's streams do not count against the second";
  auto d = Site("d", v1::Hello());
  auto e = Site("e", v1::Hello());
  distribution.Offer(d, &start);
  distribution.Offer(e, &start);
  distribution.StreamQueued();
  EXPECT_EQ(d->models.size(), 1u);
  EXPECT_TRUE(e->models.empty());
  a->FinishDownload();  // the first attempt's: frees nothing of the second's
  EXPECT_TRUE(e->models.empty());
  c->FinishDownload();
  EXPECT_EQ(e->models.size(), 1u);
}

}  // namespace
}  // namespace estuary::server
