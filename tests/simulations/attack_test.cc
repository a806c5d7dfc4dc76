// The simulator's attacks (simulations/attack.h): parsing, the seeded choice
// of malicious sites, what each attack uploads, and the report's counts.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "simulations/attack.h"
#include "simulations/report.h"

namespace estuary::simulations {
namespace {

TEST(Attack, EachKindParsesAndAnythingElseIsOneLine) {
  auto none = ParseAttack("");
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->kind, Attack::Kind::kNone);
  auto flip = ParseAttack("sign-flip");
  ASSERT_TRUE(flip.ok());
  EXPECT_EQ(flip->kind, Attack::Kind::kSignFlip);
  EXPECT_EQ(flip->parameter, 1);
  auto scaled = ParseAttack("sign-flip:4");
  ASSERT_TRUE(scaled.ok());
  EXPECT_EQ(scaled->parameter, 4);
  EXPECT_EQ(ParseAttack("scale:-3")->kind, Attack::Kind::kScale);
  EXPECT_EQ(ParseAttack("gaussian:0.5")->parameter, 0.5);
  EXPECT_EQ(ParseAttack("nan")->kind, Attack::Kind::kNan);
  EXPECT_EQ(ParseAttack("label-flip")->kind, Attack::Kind::kLabelFlip);
  for (const char* bad : {"scale", "gaussian:0", "gaussian:-1", "nan:1", "label-flip:2", "sign-flip:x", "scale:inf", "flip"}) {
    EXPECT_FALSE(ParseAttack(bad).ok()) << bad;
  }
  EXPECT_EQ(ParseAttack("poison").status().message(),
            "sim: --attack 'poison': expected sign-flip[:L], scale:L, gaussian:S, nan or label-flip");
}

TEST(Attack, TheMaliciousSitesAreTheRoundedFractionDrawnFromTheSeed) {
  const auto a = ChooseAttackers(20, 0.2, 7);
  EXPECT_EQ(std::count(a.begin(), a.end(), true), 4);
  EXPECT_EQ(ChooseAttackers(20, 0.2, 7), a) << "seeded";
  bool differs = false;
  for (uint64_t seed = 8; seed < 16; ++seed) differs |= ChooseAttackers(20, 0.2, seed) != a;
  EXPECT_TRUE(differs) << "the seed picks the sites";
  const auto all = ChooseAttackers(5, 1.0, 1);
  EXPECT_EQ(std::count(all.begin(), all.end(), true), 5);
  const auto none = ChooseAttackers(5, 0.0, 1);
  EXPECT_EQ(std::count(none.begin(), none.end(), true), 0);
}

TEST(Attack, EachAttackReplacesTheDeltaAsDocumented) {
  const std::vector<float> delta = {1, -2, 0.5f};
  auto applied = [&](const char* text, uint64_t round = 1, uint32_t site = 0) {
    std::vector<float> out = delta;
    ApplyAttack(*ParseAttack(text), out, 42, round, site);
    return out;
  };
  EXPECT_EQ(applied("sign-flip"), (std::vector<float>{-1, 2, -0.5f}));
  EXPECT_EQ(applied("sign-flip:10"), (std::vector<float>{-10, 20, -5}));
  EXPECT_EQ(applied("scale:3"), (std::vector<float>{3, -6, 1.5f}));
  for (float v : applied("nan")) EXPECT_TRUE(std::isnan(v));
  EXPECT_EQ(applied("label-flip"), delta) << "the site trained on flipped labels; its upload is its own";
  const auto noise = applied("gaussian:2");
  EXPECT_NE(noise, delta);
  EXPECT_EQ(applied("gaussian:2"), noise) << "seeded by seed, round and site";
  EXPECT_NE(applied("gaussian:2", 2), noise);
  EXPECT_NE(applied("gaussian:2", 1, 1), noise);
  // The noise's spread is S's: over many values, the sample stddev is near 2.
  std::vector<float> many(20000, 0.0f);
  ApplyAttack(*ParseAttack("gaussian:2"), many, 42, 1, 0);
  double sum2 = 0;
  for (float v : many) sum2 += double(v) * v;
  EXPECT_NEAR(std::sqrt(sum2 / double(many.size())), 2.0, 0.05);
}

TEST(Attack, TheReportCarriesTheCountsAndReadsThemBack) {
  Report report;
  report.mode = "inproc";
  report.attackers = 4;
  RoundReport row;
  row.round = 1;
  row.global_checksum = "x";
  row.attackers = 2;
  row.updates_refused = 1;
  report.rounds.push_back(row);
  auto back = ReportFromJson(ToJson(report));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->attackers, 4u);
  EXPECT_EQ(back->rounds.at(0).attackers, 2u);
  EXPECT_EQ(back->rounds.at(0).updates_refused, 1u);
  report.attackers.reset();
  report.rounds[0].attackers.reset();
  report.rounds[0].updates_refused.reset();
  const auto json = ToJson(report);
  EXPECT_FALSE(json.contains("attackers")) << "a run without an attack has no such keys";
  EXPECT_FALSE(json["rounds"][0].contains("attackers"));
}

}  // namespace
}  // namespace estuary::simulations
