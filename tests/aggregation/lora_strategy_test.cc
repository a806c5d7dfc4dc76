// LoraStrategy: the server's merge of the sites' adapters over a LoRA global
// layout. Exact gives base + adapter equal to the weighted average of the
// sites' adapted models; frozen-a keeps A; bad uploads are refused by client,
// module and field and leave nothing behind.
#include "aggregation/lora_strategy.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "models/lora_federation.h"

namespace estuary::aggregation {
namespace {

models::LlamaConfig TinyConfig() {
  return {.vocab_size = 16, .hidden_size = 16, .intermediate_size = 24, .num_layers = 2, .num_heads = 2,
          .num_kv_heads = 1, .max_seq_len = 8};
}

LoraStrategyOptions Options(LoraMergeRule rule, int rank = 4, bool mixed = false,
                            std::vector<std::string> targets = {"q_proj", "v_proj", "down_proj"}) {
  models::LoraConfig lora;
  lora.rank = rank;
  lora.alpha = 8;
  lora.target_modules = std::move(targets);
  auto layout = models::MakeLoraGlobalLayout(TinyConfig(), lora);
  EXPECT_TRUE(layout.ok()) << layout.status().ToString();
  LoraStrategyOptions options;
  options.layout = *layout;
  options.merge = {.rule = rule, .rank = size_t(rank), .alpha = 8};
  options.mixed_ranks = mixed;
  return options;
}

std::vector<float> Random(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// The weighted mean of the sites' adapted models, base + (alpha/r_i)·B_i·A_i,
// each formed by AddLoraToBase: what exact must reproduce.
std::vector<double> AverageModel(const LoraStrategyOptions& o, std::span<const float> base,
                                 const std::vector<std::pair<Manifest, std::vector<float>>>& uploads,
                                 const std::vector<double>& weights) {
  double total = 0;
  for (double w : weights) total += w;
  std::vector<double> mean(base.size(), 0.0);
  for (size_t i = 0; i < uploads.size(); ++i) {
    std::vector<float> model(base.begin(), base.end());
    EXPECT_TRUE(models::AddLoraToBase(o.layout.base, model, uploads[i].first, uploads[i].second, o.merge.alpha).ok());
    for (size_t j = 0; j < model.size(); ++j) mean[j] += weights[i] / total * double(model[j]);
  }
  return mean;
}

// The adapted model the global buffer describes: base + (alpha/r)·B·A.
std::vector<float> AdaptedModel(const LoraStrategyOptions& o, std::span<const float> global) {
  std::vector<float> model(global.begin(), global.begin() + o.layout.base.total_elements);
  Status added = models::AddLoraToBase(o.layout.base, model, o.layout.adapter,
                                       global.subspan(o.layout.adapter_offset()), o.merge.alpha);
  EXPECT_TRUE(added.ok()) << added.ToString();
  return model;
}

double RelativeError(std::span<const float> got, std::span<const double> want, std::span<const float> base) {
  // Relative to the size of the change, not of the weights: the change is what merging computes.
  double err = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    err += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += (want[i] - double(base[i])) * (want[i] - double(base[i]));
  }
  return std::sqrt(err / norm);
}

TEST(LoraStrategy, ExactMergedGlobalIsTheWeightedAverageOfTheSitesModels) {
  const LoraStrategyOptions o = Options(LoraMergeRule::kExact);
  auto strategy = LoraStrategy::Make(o);
  ASSERT_TRUE(strategy.ok()) << strategy.status().ToString();
  std::vector<float> global = Random(o.layout.global.total_elements, 1, 0.05f);
  const std::vector<float> base(global.begin(), global.begin() + o.layout.base.total_elements);
  ASSERT_TRUE((*strategy)->Begin(1, global).ok());
  std::vector<std::pair<Manifest, std::vector<float>>> uploads;
  const std::vector<double> weights = {100, 250, 40};
  for (uint32_t i = 0; i < weights.size(); ++i) {
    uploads.push_back({ExpectedLoraUpload(o), Random(o.layout.adapter.total_elements, 10 + i, 0.2f)});
    Status folded = (*strategy)->FoldUpdate(fmt::format("site-{}", i), uploads.back().first, uploads.back().second,
                                            weights[i]);
    ASSERT_TRUE(folded.ok()) << folded.ToString();
  }
  EXPECT_EQ((*strategy)->folded(), 3u);
  ASSERT_TRUE((*strategy)->Finish(global).ok());
  const std::vector<double> want = AverageModel(o, base, uploads, weights);
  const double error = RelativeError(AdaptedModel(o, global), want, base);
  EXPECT_LT(error, 1e-5);
  // Three rank-4 adapters average to rank 12 > 4: the residual went into the base.
  auto* lora = dynamic_cast<LoraStrategy*>(strategy->get());
  EXPECT_GT(lora->residual_bytes(), 0u);
  EXPECT_EQ(lora->changed_bytes(), lora->adapter_bytes() + lora->residual_bytes());
  EXPECT_EQ(lora->adapter_bytes(), o.layout.adapter.byte_size());
  EXPECT_NE(std::vector<float>(global.begin(), global.begin() + base.size()), base);

  // The same updates averaged naively do not give that model.
  LoraStrategyOptions naive_options = Options(LoraMergeRule::kNaive);
  auto naive = LoraStrategy::Make(naive_options);
  ASSERT_TRUE(naive.ok());
  std::vector<float> naive_global = Random(o.layout.global.total_elements, 1, 0.05f);
  ASSERT_TRUE((*naive)->Begin(1, naive_global).ok());
  for (size_t i = 0; i < uploads.size(); ++i) {
    ASSERT_TRUE((*naive)->FoldUpdate("site", uploads[i].first, uploads[i].second, weights[i]).ok());
  }
  ASSERT_TRUE((*naive)->Finish(naive_global).ok());
  EXPECT_EQ(std::vector<float>(naive_global.begin(), naive_global.begin() + base.size()), base);  // base kept
  EXPECT_GT(RelativeError(AdaptedModel(naive_options, naive_global), want, base), 0.1);
}

TEST(LoraStrategy, ExactTakesSitesOfOtherRanksWhenTheFederationAllowsIt) {
  const LoraStrategyOptions o = Options(LoraMergeRule::kExact, 4, /*mixed=*/true);
  auto strategy = LoraStrategy::Make(o);
  ASSERT_TRUE(strategy.ok());
  std::vector<float> global = Random(o.layout.global.total_elements, 2, 0.05f);
  const std::vector<float> base(global.begin(), global.begin() + o.layout.base.total_elements);
  ASSERT_TRUE((*strategy)->Begin(1, global).ok());
  std::vector<std::pair<Manifest, std::vector<float>>> uploads;
  const std::vector<double> weights = {3, 1};
  for (int rank : {2, 8}) {
    const LoraStrategyOptions other = Options(LoraMergeRule::kExact, rank);
    uploads.push_back({other.layout.adapter, Random(other.layout.adapter.total_elements, 20 + rank, 0.2f)});
    Status folded = (*strategy)->FoldUpdate(fmt::format("rank-{}", rank), uploads.back().first,
                                            uploads.back().second, weights[uploads.size() - 1]);
    ASSERT_TRUE(folded.ok()) << folded.ToString();
  }
  ASSERT_TRUE((*strategy)->Finish(global).ok());
  EXPECT_LT(RelativeError(AdaptedModel(o, global), AverageModel(o, base, uploads, weights), base), 1e-5);

  // Without mixed ranks the same rank-8 upload is refused, by name.
  auto strict = LoraStrategy::Make(Options(LoraMergeRule::kExact, 4));
  ASSERT_TRUE(strict.ok());
  ASSERT_TRUE((*strict)->Begin(1, global).ok());
  Status refused = (*strict)->FoldUpdate("site-9", uploads[1].first, uploads[1].second, 1);
  EXPECT_FALSE(refused.ok());
  EXPECT_EQ(refused.message(),
            "lora update from site-9: module base_model.model.model.layers.0.self_attn.q_proj: lora_A rank 8, the "
            "federation's is 4");
  EXPECT_EQ((*strict)->folded(), 0u);
  // Mixed ranks are exact's alone.
  EXPECT_FALSE(LoraStrategy::Make(Options(LoraMergeRule::kNaive, 4, true)).ok());
}

TEST(LoraStrategy, FrozenATakesBOnlyAndKeepsTheFederationsA) {
  const LoraStrategyOptions o = Options(LoraMergeRule::kFrozenA);
  auto strategy = LoraStrategy::Make(o);
  ASSERT_TRUE(strategy.ok());
  std::vector<float> global = Random(o.layout.global.total_elements, 3, 0.05f);
  const std::vector<float> before = global;
  ASSERT_TRUE((*strategy)->Begin(1, global).ok());
  const Manifest upload = ExpectedLoraUpload(o);
  for (const auto& spec : upload.tensors) EXPECT_FALSE(models::IsLoraA(spec.name)) << spec.name;
  std::vector<std::vector<float>> bs;
  for (uint32_t i = 0; i < 2; ++i) {
    bs.push_back(Random(upload.total_elements, 30 + i, 0.2f));
    ASSERT_TRUE((*strategy)->FoldUpdate("site", upload, bs.back(), i == 0 ? 1.0 : 3.0).ok());
  }
  ASSERT_TRUE((*strategy)->Finish(global).ok());
  const uint64_t at = o.layout.adapter_offset();
  for (const auto& spec : o.layout.adapter.tensors) {
    for (uint64_t j = 0; j < spec.numel(); ++j) {
      const float got = global[at + spec.offset + j];
      if (models::IsLoraA(spec.name)) {
        ASSERT_EQ(got, before[at + spec.offset + j]) << spec.name;
      } else {
        const uint64_t k = upload.Find(spec.name)->offset + j;
        ASSERT_NEAR(got, 0.25f * bs[0][k] + 0.75f * bs[1][k], 1e-6f) << spec.name;
      }
    }
  }
  // A full adapter is not what a frozen-a federation takes.
  Status refused = (*strategy)->FoldUpdate("site-a", o.layout.adapter,
                                           std::vector<float>(o.layout.adapter.total_elements), 1);
  EXPECT_NE(refused.message().find("lora update from site-a: module base_model.model.model.layers.0.self_attn.q_proj: "
                                   "lora_A is not in the federation's B-only (frozen-a) upload"),
            std::string::npos)
      << refused.message();
}

// A factor large enough for the merge to overflow float is refused at its
// own fold, so the round finishes with the others; the largest factor
// allowed still merges to a finite model.
TEST(LoraStrategy, AnAdapterWhoseMergeWouldOverflowIsRefusedAtItsFold) {
  for (LoraMergeRule rule : {LoraMergeRule::kExact, LoraMergeRule::kNaive}) {
    SCOPED_TRACE(LoraMergeRuleName(rule));
    const LoraStrategyOptions o = Options(rule);
    auto strategy = LoraStrategy::Make(o);
    ASSERT_TRUE(strategy.ok());
    std::vector<float> global = Random(o.layout.global.total_elements, 5, 0.05f);
    ASSERT_TRUE((*strategy)->Begin(1, global).ok());
    const Manifest layout = ExpectedLoraUpload(o);
    Status refused = (*strategy)->FoldUpdate("poisoner", layout, std::vector<float>(layout.total_elements, 1e19f), 1);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.message().find("is 1e+19, beyond 3.26e+18: the merge would overflow float"), std::string::npos)
        << refused.message();
    EXPECT_EQ((*strategy)->folded(), 0u);
    ASSERT_TRUE((*strategy)->FoldUpdate("large", layout, std::vector<float>(layout.total_elements, 3e18f), 1).ok());
    ASSERT_TRUE((*strategy)->FoldUpdate("honest", layout, Random(layout.total_elements, 6, 0.2f), 1).ok());
    ASSERT_TRUE((*strategy)->Finish(global).ok());
    for (float v : AdaptedModel(o, global)) ASSERT_TRUE(std::isfinite(v));
  }
}

TEST(LoraStrategy, BadUploadsAreRefusedByClientModuleAndFieldAndNotKept) {
  const LoraStrategyOptions o = Options(LoraMergeRule::kExact);
  auto strategy = LoraStrategy::Make(o);
  ASSERT_TRUE(strategy.ok());
  std::vector<float> global = Random(o.layout.global.total_elements, 4, 0.05f);
  ASSERT_TRUE((*strategy)->Begin(1, global).ok());
  const Manifest good = ExpectedLoraUpload(o);
  const std::string q = "base_model.model.model.layers.0.self_attn.q_proj";

  struct Case {
    const char* what;
    Manifest manifest;
    std::string message;
  };
  std::vector<Case> cases;
  {  // A module the federation does not adapt (k_proj).
    auto other = Options(LoraMergeRule::kExact, 4, false, {"q_proj", "k_proj", "v_proj", "down_proj"});
    cases.push_back({"extra module", other.layout.adapter,
                     "lora update from bad: module base_model.model.model.layers.0.self_attn.k_proj: lora_A is not "
                     "among the federation's target modules"});
  }
  {  // The last module's B left out.
    Manifest m = good;
    m.total_elements -= m.tensors.back().numel();
    m.tensors.pop_back();
    cases.push_back({"missing factor", m,
                     "lora update from bad: module base_model.model.model.layers.1.mlp.down_proj: lora_B missing (11 "
                     "of 12 tensors sent)"});
  }
  {  // q_proj's A with another in_features.
    Manifest m = good;
    m.tensors[0].shape = {4, 12};
    cases.push_back({"shape", m, fmt::format("lora update from bad: module {}: lora_A in_features 12, the "
                                             "federation's is 16", q)});
  }
  {  // B's rank disagreeing with its A's (mixed ranks would allow rank 2, not two ranks).
    Manifest m = good;
    m.tensors[1].shape = {16, 2};
    cases.push_back({"B rank", m, fmt::format("lora update from bad: module {}: lora_B rank 2, the federation's is 4", q)});
  }
  {  // Not a LoRA tensor at all.
    Manifest m = good;
    m.tensors[0].name = "model.layers.0.self_attn.q_proj.weight";
    cases.push_back({"base tensor", m,
                     "lora update from bad: tensor model.layers.0.self_attn.q_proj.weight: not a LoRA factor (the "
                     "upload holds adapters only)"});
  }
  for (const Case& c : cases) {
    Status refused = (*strategy)->FoldUpdate("bad", c.manifest, std::vector<float>(c.manifest.total_elements), 1);
    EXPECT_FALSE(refused.ok()) << c.what;
    EXPECT_EQ(refused.message(), c.message) << c.what;
    EXPECT_EQ(refused.message().find('\n'), std::string::npos) << c.what;
  }
  // Right layout, a non-finite value: refused too.
  std::vector<float> values = Random(good.total_elements, 5, 0.1f);
  values[good.tensors[3].offset + 2] = NAN;
  Status refused = (*strategy)->FoldUpdate("nan-site", good, values, 1);
  EXPECT_EQ(refused.message(),
            "lora update from nan-site: module base_model.model.model.layers.0.self_attn.v_proj: lora_B element 2 is "
            "nan");
  EXPECT_EQ((*strategy)->folded(), 0u);
  EXPECT_FALSE((*strategy)->Finish(global).ok());  // nothing reached the aggregate

  // One good upload still merges.
  values[good.tensors[3].offset + 2] = 0.5f;
  ASSERT_TRUE((*strategy)->FoldUpdate("good", good, values, 1).ok());
  EXPECT_TRUE((*strategy)->Finish(global).ok());
}

}  // namespace
}  // namespace estuary::aggregation
