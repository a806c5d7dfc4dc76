// LoRA merging: exact reproduces the average update, naive does not, frozen-a
// is exact when A is shared, and mismatched updates are refused by name.
#include "aggregation/lora_merge.h"

#include <cblas.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>

namespace estuary::aggregation {
namespace {

LoraAdapter RandomAdapter(std::mt19937& rng, size_t rank, size_t in, size_t out, float alpha) {
  // Scales like a trained adapter: A as PEFT initialises it, B grown away from 0.
  std::normal_distribution<float> a_dist(0.0f, 1.0f / std::sqrt(float(in)));
  std::normal_distribution<float> b_dist(0.0f, 0.1f);
  LoraAdapter adapter{.rank = rank, .in = in, .out = out, .alpha = alpha};
  adapter.a.resize(rank * in);
  adapter.b.resize(out * rank);
  for (float& v : adapter.a) v = a_dist(rng);
  for (float& v : adapter.b) v = b_dist(rng);
  return adapter;
}

// Σ w_i (alpha_i / r_i) B_i A_i / Σ w_i, by one dgemm per client in double:
// the reference every rule is judged against.
std::vector<double> DirectAverage(std::span<const LoraAdapter> clients, std::span<const double> weights) {
  double total = 0;
  for (double w : weights) total += w;
  const size_t out = clients[0].out, in = clients[0].in;
  std::vector<double> average(out * in, 0.0);
  for (size_t i = 0; i < clients.size(); ++i) {
    const LoraAdapter& c = clients[i];
    std::vector<double> a(c.a.begin(), c.a.end()), b(c.b.begin(), c.b.end());
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(out), int(in), int(c.rank),
                weights[i] / total * c.scale(), b.data(), int(c.rank), a.data(), int(in), 1.0, average.data(), int(in));
  }
  return average;
}

// What the merged model adds to the base: (alpha/r)·B'·A' + residual.
std::vector<float> MergedDelta(const MergedLoraModule& merged) {
  std::vector<float> delta = LoraDelta(merged.adapter);
  if (!merged.residual.empty()) merged.residual.AddTo(delta);
  return delta;
}

double RelativeError(std::span<const float> got, std::span<const double> want) {
  double diff = 0, norm = 0;
  for (size_t k = 0; k < want.size(); ++k) {
    diff += (got[k] - want[k]) * (got[k] - want[k]);
    norm += want[k] * want[k];
  }
  return std::sqrt(diff / norm);
}

std::vector<LoraAdapter> RandomClients(uint32_t seed, std::initializer_list<size_t> ranks,
                                       std::initializer_list<float> alphas, size_t in, size_t out) {
  std::mt19937 rng(seed);
  std::vector<LoraAdapter> clients;
  auto alpha = alphas.begin();
  for (size_t rank : ranks) clients.push_back(RandomAdapter(rng, rank, in, out, *alpha++));
  return clients;
}

LoraMergeOptions Exact(size_t rank, float alpha) {
  return {.rule = LoraMergeRule::kExact, .rank = rank, .alpha = alpha};
}

TEST(LoraMergeExact, EqualRanksMatchTheAverageUpdate) {
  const auto clients = RandomClients(1, {8, 8, 8, 8, 8}, {16, 16, 16, 16, 16}, 48, 64);
  const std::vector<double> weights = {120, 30, 75, 400, 9};
  auto merged = MergeLoraModule("q_proj", clients, weights, Exact(8, 16));
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();
  ASSERT_EQ(merged->adapter.rank, 8u);
  ASSERT_FALSE(merged->residual.empty()) << "Σ rank 40 > 8: the truncation must leave a residual";
  // As factors: the five clients' and the merged adapter's, rank 40 + 8.
  EXPECT_EQ(merged->residual.rank, 48u);
  EXPECT_EQ(merged->residual.rows, 64u);
  EXPECT_EQ(merged->residual.cols, 48u);
  EXPECT_EQ(merged->residual_bytes(), 4u * 64 * 48) << "64 x 48 dense is smaller than rank 48 factors";
  const double error = RelativeError(MergedDelta(*merged), DirectAverage(clients, weights));
  std::printf("exact, ranks 5 x 8 -> 8: relative error %.3g\n", error);
  EXPECT_LE(error, 1e-5);
}

TEST(LoraMergeExact, HeterogeneousRanksAndAlphasMatchTheAverageUpdate) {
  const auto clients = RandomClients(2, {4, 8, 16}, {8, 16, 64}, 96, 80);
  const std::vector<double> weights = {10, 250, 47};
  for (size_t target : {4, 8, 12}) {
    auto merged = MergeLoraModule("v_proj", clients, weights, Exact(target, 2.0f * target));
    ASSERT_TRUE(merged.ok()) << merged.status().ToString();
    EXPECT_EQ(merged->adapter.rank, target);
    EXPECT_EQ(merged->adapter.a.size(), target * 96);
    EXPECT_EQ(merged->singular_values.size(), 28u);
    const double error = RelativeError(MergedDelta(*merged), DirectAverage(clients, weights));
    std::printf("exact, ranks 4/8/16 alphas 8/16/64 -> %zu: relative error %.3g\n", target, error);
    EXPECT_LE(error, 1e-5) << "target rank " << target;
  }
}

TEST(LoraMergeExact, NoResidualWhenTheTargetRankCoversTheStack) {
  const auto clients = RandomClients(3, {4, 8, 16}, {8, 16, 32}, 96, 80);
  const std::vector<double> weights = {3, 1, 2};
  for (size_t target : {28, 32}) {  // Σ rank_i = 28
    auto merged = MergeLoraModule("o_proj", clients, weights, Exact(target, 16));
    ASSERT_TRUE(merged.ok()) << merged.status().ToString();
    EXPECT_TRUE(merged->residual.empty()) << "target rank " << target;
    EXPECT_EQ(merged->residual_bytes(), 0u);
    const double error = RelativeError(LoraDelta(merged->adapter), DirectAverage(clients, weights));
    std::printf("exact, ranks 4/8/16 -> %zu, adapter alone: relative error %.3g\n", target, error);
    EXPECT_LE(error, 1e-5) << "target rank " << target;
  }
}

TEST(LoraMergeExact, StackWiderThanTheMatrixAndAZeroB) {
  // Σ rank 20 > in 12: the QRs give 16 x 20 and 12 x 20 trapezoids. Client 1
  // sends B = 0, as PEFT initialises it.
  auto clients = RandomClients(16, {8, 4, 8}, {16, 8, 16}, 12, 16);
  std::fill(clients[1].b.begin(), clients[1].b.end(), 0.0f);
  const std::vector<double> weights = {1, 2, 3};
  for (size_t target : {4, 12, 16}) {
    auto merged = MergeLoraModule("tiny", clients, weights, Exact(target, 8));
    ASSERT_TRUE(merged.ok()) << merged.status().ToString();
    EXPECT_EQ(merged->singular_values.size(), 12u);
    EXPECT_EQ(merged->residual.empty(), target >= 12) << "target rank " << target;
    EXPECT_LE(RelativeError(MergedDelta(*merged), DirectAverage(clients, weights)), 1e-5) << "target " << target;
    if (target == 16) {  // only 12 directions exist: the rest of the adapter is zero
      for (size_t x = 0; x < 12; ++x) EXPECT_EQ(merged->adapter.a[15 * 12 + x], 0.0f);
    }
  }
}

TEST(LoraMergeExact, TruncationDropsOnlyTheTrailingSingularValues) {
  // Eckart–Young: the best rank-r approximation leaves exactly Σ_{j>r} σ_j².
  const auto clients = RandomClients(4, {4, 8, 16}, {8, 16, 32}, 96, 80);
  const std::vector<double> weights = {5, 2, 9};
  auto merged = MergeLoraModule("k_proj", clients, weights, Exact(8, 16));
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();
  const auto& sigma = merged->singular_values;
  ASSERT_EQ(sigma.size(), 28u);
  for (size_t j = 1; j < sigma.size(); ++j) EXPECT_GE(sigma[j - 1], sigma[j]);
  double tail2 = 0;
  for (size_t j = 8; j < sigma.size(); ++j) tail2 += sigma[j] * sigma[j];
  double residual2 = 0;
  for (float v : merged->residual.Dense()) residual2 += double(v) * v;
  EXPECT_NEAR(std::sqrt(residual2), std::sqrt(tail2), 1e-5 * std::sqrt(tail2));
}

TEST(LoraMergeNaive, IsMeasurablyOffTheAverageUpdate) {
  const auto clients = RandomClients(5, {8, 8, 8, 8, 8}, {16, 16, 16, 16, 16}, 48, 64);
  const std::vector<double> weights = {120, 30, 75, 400, 9};
  auto merged = MergeLoraModule("q_proj", clients, weights, {.rule = LoraMergeRule::kNaive});
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();
  EXPECT_TRUE(merged->residual.empty());
  const double error = RelativeError(MergedDelta(*merged), DirectAverage(clients, weights));
  std::printf("naive, 5 clients of rank 8: relative error %.3g against the average update\n", error);
  EXPECT_GT(error, 0.1);
}

TEST(LoraMergeNaive, EqualsExactWhenAllClientsAreIdentical) {
  const auto one = RandomClients(6, {8}, {16}, 48, 64);
  const std::vector<LoraAdapter> clients(3, one[0]);
  const std::vector<double> weights = {1, 7, 30};
  auto naive = MergeLoraModule("q_proj", clients, weights, {.rule = LoraMergeRule::kNaive});
  auto exact = MergeLoraModule("q_proj", clients, weights, Exact(8, 16));
  ASSERT_TRUE(naive.ok()) << naive.status().ToString();
  ASSERT_TRUE(exact.ok()) << exact.status().ToString();
  EXPECT_TRUE(exact->residual.empty()) << "three copies of one rank-8 update have rank 8";
  const auto want = DirectAverage(clients, weights);
  EXPECT_LE(RelativeError(MergedDelta(*naive), want), 1e-6);
  EXPECT_LE(RelativeError(MergedDelta(*exact), want), 1e-5);
}

TEST(LoraMergeNaive, RefusesUnequalRanksAndAlphas) {
  const std::vector<double> weights = {1, 1, 1};
  auto ranks = MergeLoraModule("q_proj", RandomClients(7, {8, 8, 4}, {16, 16, 16}, 32, 32), weights,
                               {.rule = LoraMergeRule::kNaive});
  ASSERT_FALSE(ranks.ok());
  EXPECT_NE(ranks.status().message().find("client 2: module q_proj: rank 4"), std::string::npos)
      << ranks.status().message();
  auto alphas = MergeLoraModule("q_proj", RandomClients(7, {8, 8, 8}, {16, 32, 16}, 32, 32), weights,
                                {.rule = LoraMergeRule::kNaive});
  ASSERT_FALSE(alphas.ok());
  EXPECT_NE(alphas.status().message().find("client 1: module q_proj: alpha 32"), std::string::npos)
      << alphas.status().message();
}

TEST(LoraMergeFrozenA, IsExactWithASharedA) {
  auto clients = RandomClients(8, {8, 8, 8, 8}, {16, 16, 16, 16}, 48, 64);
  for (auto& c : clients) c.a = clients[0].a;
  const std::vector<double> weights = {4, 1, 9, 2};
  auto merged = MergeLoraModule("q_proj", clients, weights, {.rule = LoraMergeRule::kFrozenA});
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();
  EXPECT_EQ(merged->adapter.a, clients[0].a);
  const double error = RelativeError(MergedDelta(*merged), DirectAverage(clients, weights));
  std::printf("frozen-a, 4 clients of rank 8: relative error %.3g\n", error);
  EXPECT_LE(error, 1e-6);
}

TEST(LoraMergeFrozenA, RefusesClientsWhoseADiffer) {
  auto clients = RandomClients(9, {8, 8, 8}, {16, 16, 16}, 48, 64);
  for (auto& c : clients) c.a = clients[0].a;
  clients[2].a[17] = std::nextafter(clients[2].a[17], 1.0f);  // one ulp
  auto merged = MergeLoraModule("q_proj", clients, std::vector<double>{1, 1, 1}, {.rule = LoraMergeRule::kFrozenA});
  ASSERT_FALSE(merged.ok());
  EXPECT_NE(merged.status().message().find("client 2: module q_proj: a differs from client 0's at [17]"),
            std::string::npos)
      << merged.status().message();
  // Same value, different bits: 0.0 and -0.0 are not the same A.
  clients[2].a = clients[0].a;
  clients[0].a[3] = 0.0f;
  clients[1].a[3] = 0.0f;
  clients[2].a[3] = -0.0f;
  merged = MergeLoraModule("q_proj", clients, std::vector<double>{1, 1, 1}, {.rule = LoraMergeRule::kFrozenA});
  ASSERT_FALSE(merged.ok());
  EXPECT_NE(merged.status().message().find("client 2: module q_proj: a differs from client 0's at [3]"),
            std::string::npos)
      << merged.status().message();
}

// Three clients, two modules each; client 2 is the one spoiled by each case.
std::vector<LoraUpdate> Federation(uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<LoraUpdate> clients(3);
  for (auto& c : clients) {
    c.modules["layers.0.q_proj"] = RandomAdapter(rng, 4, 32, 32, 8);
    c.modules["layers.0.v_proj"] = RandomAdapter(rng, 4, 32, 24, 8);
  }
  return clients;
}

void ExpectRefused(const std::vector<LoraUpdate>& clients, LoraMergeRule rule, const std::string& needle) {
  const Status status = CheckLoraUpdates(clients, rule);
  ASSERT_FALSE(status.ok()) << "expected a refusal containing '" << needle << "'";
  EXPECT_EQ(status.code(), Code::kInvalidArgument);
  EXPECT_NE(status.message().find(needle), std::string::npos) << status.message();
  EXPECT_EQ(status.message().find('\n'), std::string::npos) << "one line";
  auto merged = MergeLoraUpdates(clients, std::vector<double>(clients.size(), 1.0), {.rule = rule, .rank = 4});
  ASSERT_FALSE(merged.ok());
  EXPECT_EQ(merged.status().message(), status.message()) << "MergeLoraUpdates refuses with the same check";
  std::printf("refused: %s\n", status.message().c_str());
}

TEST(LoraMergeBadInput, EachMismatchNamesClientModuleAndField) {
  auto missing = Federation(10);
  missing[2].modules.erase("layers.0.v_proj");
  ExpectRefused(missing, LoraMergeRule::kExact, "client 2: module layers.0.v_proj: missing");

  auto extra = Federation(10);
  extra[2].modules["layers.0.k_proj"] = extra[2].modules["layers.0.q_proj"];
  ExpectRefused(extra, LoraMergeRule::kExact, "client 2: module layers.0.k_proj: unexpected");

  auto shape = Federation(10);
  std::mt19937 rng(11);
  shape[2].modules["layers.0.v_proj"] = RandomAdapter(rng, 4, 32, 32, 8);
  ExpectRefused(shape, LoraMergeRule::kExact, "client 2: module layers.0.v_proj: shape (in 32, out 32) differs");

  auto rank = Federation(10);
  rank[2].modules["layers.0.q_proj"] = RandomAdapter(rng, 8, 32, 32, 8);
  ExpectRefused(rank, LoraMergeRule::kNaive, "client 2: module layers.0.q_proj: rank 8 differs");
  ExpectRefused(rank, LoraMergeRule::kFrozenA, "client 2: module layers.0.q_proj: rank 8 differs");
  EXPECT_TRUE(CheckLoraUpdates(rank, LoraMergeRule::kExact).ok()) << "exact merges heterogeneous ranks";

  auto alpha = Federation(10);
  alpha[2].modules["layers.0.q_proj"].alpha = 16;
  ExpectRefused(alpha, LoraMergeRule::kNaive, "client 2: module layers.0.q_proj: alpha 16 differs");

  auto size = Federation(10);
  size[2].modules["layers.0.v_proj"].a.pop_back();
  ExpectRefused(size, LoraMergeRule::kExact, "client 2: module layers.0.v_proj: a has 127 values");

  auto nan = Federation(10);
  nan[2].modules["layers.0.q_proj"].b[5] = std::nanf("");
  ExpectRefused(nan, LoraMergeRule::kExact, "client 2: module layers.0.q_proj: b[5] is nan");
}

TEST(LoraMergeBadInput, WeightsAndOptions) {
  const auto clients = Federation(12);
  auto count = MergeLoraUpdates(clients, std::vector<double>{1, 1}, Exact(4, 8));
  ASSERT_FALSE(count.ok());
  EXPECT_NE(count.status().message().find("2 weights for 3 clients"), std::string::npos) << count.status().message();
  auto weight = MergeLoraUpdates(clients, std::vector<double>{1, 0, 1}, Exact(4, 8));
  ASSERT_FALSE(weight.ok());
  EXPECT_NE(weight.status().message().find("client 1: weight must be finite and > 0"), std::string::npos)
      << weight.status().message();
  auto rank = MergeLoraUpdates(clients, std::vector<double>{1, 1, 1}, Exact(0, 8));
  ASSERT_FALSE(rank.ok());
  EXPECT_NE(rank.status().message().find("target rank > 0"), std::string::npos) << rank.status().message();
  auto rule = ParseLoraMergeRule("fedex");
  ASSERT_FALSE(rule.ok());
  EXPECT_NE(rule.status().message().find("'fedex'"), std::string::npos);
  for (auto r : {LoraMergeRule::kNaive, LoraMergeRule::kExact, LoraMergeRule::kFrozenA}) {
    EXPECT_EQ(*ParseLoraMergeRule(LoraMergeRuleName(r)), r);
  }
}

TEST(LoraMergeSet, MergesEveryModuleAndCountsTheBytes) {
  auto clients = Federation(13);
  clients[1].modules["layers.0.q_proj"] = RandomClients(14, {8}, {16}, 32, 32)[0];  // heterogeneous ranks
  const std::vector<double> weights = {2, 5, 3};
  auto merged = MergeLoraUpdates(clients, weights, Exact(4, 8));
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();
  ASSERT_EQ(merged->modules.size(), 2u);
  uint64_t adapters = 0, residuals = 0;
  for (const auto& [name, module] : merged->modules) {
    std::vector<LoraAdapter> column;
    for (const auto& c : clients) column.push_back(c.modules.at(name));
    EXPECT_LE(RelativeError(MergedDelta(module), DirectAverage(column, weights)), 1e-5) << name;
    adapters += module.adapter.bytes();
    residuals += module.residual_bytes();
  }
  EXPECT_EQ(merged->adapter_bytes, 4u * 4 * (32 + 32) + 4u * 4 * (32 + 24));
  EXPECT_EQ(merged->adapter_bytes, adapters);
  EXPECT_EQ(merged->residual_bytes, 4u * (32 * 32 + 24 * 32)) << "Σ rank 12 or 16 > 4 in both modules";
  EXPECT_EQ(merged->residual_bytes, residuals);
}

// The docs/LORA.md figure: bytes per round for the ~124M decoder ("llama-124m":
// d 768, 12 layers, MLP 2048, 50,304-token tied vocabulary) with q/k/v/o
// adapted at rank 8 and 10 clients, measured from a real exact merge.
TEST(LoraMergeBytes, Decoder124M) {
  constexpr size_t kD = 768, kLayers = 12, kMlp = 2048, kVocab = 50304, kRank = 8, kClients = 10;
  const uint64_t parameters = kVocab * kD + kLayers * (4 * kD * kD + 3 * kD * kMlp + 2 * kD) + kD;
  std::mt19937 rng(15);
  std::vector<LoraUpdate> clients(kClients);
  for (size_t layer = 0; layer < kLayers; ++layer) {
    for (const char* proj : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
      const std::string name = "model.layers." + std::to_string(layer) + ".self_attn." + proj;
      for (auto& c : clients) c.modules[name] = RandomAdapter(rng, kRank, kD, kD, 16);
    }
  }
  const std::vector<double> weights(kClients, 1.0);
  const double mib = 1024.0 * 1024.0;
  const uint64_t lora_up = clients[0].bytes(), full_up = 4 * parameters;
  std::printf("llama-124m: %llu parameters; %zu adapted modules, rank %zu, %zu clients\n",
              static_cast<unsigned long long>(parameters), clients[0].modules.size(), kRank, kClients);
  std::printf("| update | up per client | up per round | down per client |\n|---|---|---|---|\n");
  std::printf("| full delta | %.2f MiB | %.1f MiB | %.2f MiB (new weights) |\n", full_up / mib,
              kClients * full_up / mib, full_up / mib);
  for (auto rule : {LoraMergeRule::kNaive, LoraMergeRule::kFrozenA, LoraMergeRule::kExact}) {
    auto round = clients;
    if (rule == LoraMergeRule::kFrozenA) {
      for (auto& c : round) {
        for (auto& [name, adapter] : c.modules) adapter.a = round[0].modules.at(name).a;
      }
    }
    const auto start = std::chrono::steady_clock::now();
    auto merged = MergeLoraUpdates(round, weights, {.rule = rule, .rank = kRank, .alpha = 16});
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_TRUE(merged.ok()) << merged.status().ToString();
    const uint64_t down = merged->adapter_bytes + merged->residual_bytes;
    // Under frozen-a only B travels up; A is fixed at the start of training.
    const uint64_t up = rule == LoraMergeRule::kFrozenA ? lora_up / 2 : lora_up;
    std::printf("| lora, %s | %.2f MiB | %.1f MiB | %.2f MiB (adapters %.2f + residuals %.2f); merge %.2f s |\n",
                std::string(LoraMergeRuleName(rule)).c_str(), up / mib, kClients * up / mib, down / mib,
                merged->adapter_bytes / mib, merged->residual_bytes / mib, seconds);
    EXPECT_EQ(merged->adapter_bytes, up);  // down as up: frozen-a's A never changes, so B alone comes back
    // exact: each residual as its factors, the 10 clients' and the merged adapter's
    // (rank 10 x 8 + 8 = 88, 88 x (768 + 768) values against 768 x 768 dense).
    EXPECT_EQ(merged->residual_bytes, rule == LoraMergeRule::kExact ? 48 * 4 * 88 * (kD + kD) : 0);
  }
}

}  // namespace
}  // namespace estuary::aggregation
