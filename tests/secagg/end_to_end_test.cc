// SecAgg+ arithmetic end to end without a network: sites advertise keys,
// share their secrets among their neighbours in AES-GCM envelopes, mask
// their quantised updates chunk by chunk, some drop, and the "server" (plain
// code here) reconstructs what it needs from the survivors' shares. The
// unmasked sum must equal the plaintext sum of the same quantised vectors bit
// for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <set>

#include "secagg/envelope.h"
#include "secagg/key_agreement.h"
#include "secagg/masking.h"
#include "secagg/neighbours.h"
#include "secagg/prg.h"
#include "secagg/quantize.h"
#include "secagg/shamir.h"
#include "tests/secagg/test_util.h"

namespace estuary::secagg {
namespace {

constexpr uint64_t kRound = 17;
constexpr size_t kDimension = 10'007;  // not a whole number of AES blocks (4 words)
const std::vector<size_t> kChunkCuts = {0, 3001, 8192, kDimension};

struct Site {
  uint32_t id = 0;
  X25519KeyPair mask_keys, share_keys;
  Key32 self_seed{};
  double weight = 0;
  std::vector<float> update;
  std::vector<uint32_t> quantized, masked;
};

struct Scenario {
  int sites = 10;
  int degree = 9;
  std::set<uint32_t> never_sent;            // dropped after masking: their vectors never arrive
  std::set<uint32_t> silent_in_unmasking;   // their vectors arrived, then they dropped
};

struct Outcome {
  std::vector<uint32_t> masked_sum;  // what arrived, summed, before any correction
  std::vector<uint32_t> unmasked, plaintext_sum;
  std::vector<double> dequantized, float_mean;
  double bound = 0;
};

const QuantizationConfig kConfig{.bits = 24, .clip_norm = 1.0, .scale = 4096};

Result<Outcome> RunRound(const Scenario& scenario) {
  const int n = scenario.sites;
  ESTUARY_ASSIGN_OR_RETURN(NeighbourGraph graph,
                           NeighbourGraph::Harary(n, scenario.degree, testing::CountingKey(99)));
  const int threshold = DefaultThreshold(scenario.degree);

  // Advertise keys: each site's two public keys and its commitments reach
  // the server and, through it, its neighbours.
  std::vector<Site> sites(n);
  std::mt19937 data(1234);  // test data only; nothing secret comes from it
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (int u = 0; u < n; ++u) {
    Site& site = sites[u];
    site.id = static_cast<uint32_t>(u);
    ESTUARY_ASSIGN_OR_RETURN(site.mask_keys, GenerateX25519KeyPair());
    ESTUARY_ASSIGN_OR_RETURN(site.share_keys, GenerateX25519KeyPair());
    ESTUARY_ASSIGN_OR_RETURN(site.self_seed, RandomKey());
    site.weight = 10.0 * (u + 1);
    site.update.resize(kDimension);
    for (float& x : site.update) x = normal(data);  // norm ≈ 2: clipping to 1 happens
  }
  std::map<uint32_t, Commitment> seed_commitment, key_commitment;
  for (const Site& site : sites) {
    seed_commitment[site.id] = CommitToSecret(site.self_seed);
    key_commitment[site.id] = CommitToSecret(site.mask_keys.private_key);
  }

  // Share keys: u splits b_u and sk_u among its neighbours (x = id + 1) and
  // seals each pair of shares to its holder; the server only relays.
  std::map<std::pair<uint32_t, uint32_t>, std::vector<uint8_t>> mailbox;  // (from, to) -> envelope
  for (const Site& site : sites) {
    const auto& holders = graph.Neighbours(site.id);
    std::vector<uint32_t> xs;
    for (uint32_t v : holders) xs.push_back(v + 1);
    ESTUARY_ASSIGN_OR_RETURN(SharedSecret seed_shares, Split(site.self_seed, threshold, xs));
    ESTUARY_ASSIGN_OR_RETURN(SharedSecret key_shares, Split(site.mask_keys.private_key, threshold, xs));
    for (size_t i = 0; i < holders.size(); ++i) {
      const uint32_t v = holders[i];
      ESTUARY_ASSIGN_OR_RETURN(Key32 key, AgreeRoundKey(site.share_keys.private_key, sites[v].share_keys.public_key,
                                                        kShareKeyLabel, kRound));
      std::vector<uint8_t> payload(seed_shares.shares[i].y.begin(), seed_shares.shares[i].y.end());
      payload.insert(payload.end(), key_shares.shares[i].y.begin(), key_shares.shares[i].y.end());
      const EnvelopeContext context{.sender = site.id, .receiver = v, .round = kRound};
      ESTUARY_ASSIGN_OR_RETURN(mailbox[std::pair(site.id, v)], Seal(key, context, payload));
    }
  }

  // Masked input collection, chunk by chunk as an upload would stream.
  for (Site& site : sites) {
    std::vector<PeerPublicKey> peers;
    for (uint32_t v : graph.Neighbours(site.id)) peers.push_back({v, sites[v].mask_keys.public_key});
    ESTUARY_ASSIGN_OR_RETURN(std::vector<PairwiseKey> pairwise,
                             PairwiseMaskKeys(site.id, site.mask_keys.private_key, peers, kRound));
    ESTUARY_ASSIGN_OR_RETURN(Key32 rounding_seed, RandomKey());
    ESTUARY_ASSIGN_OR_RETURN(site.quantized, Quantize(site.update, site.weight, kConfig, rounding_seed));
    site.masked = site.quantized;
    for (size_t c = 0; c + 1 < kChunkCuts.size(); ++c) {
      ESTUARY_RETURN_IF_ERROR(MaskChunk(site.id, site.self_seed, pairwise, kConfig.bits, kChunkCuts[c],
                                        std::span(site.masked).subspan(kChunkCuts[c], kChunkCuts[c + 1] - kChunkCuts[c])));
    }
  }

  // The server sums what arrived.
  std::set<uint32_t> included;
  for (int u = 0; u < n; ++u) {
    if (!scenario.never_sent.contains(u)) included.insert(u);
  }
  Outcome outcome;
  outcome.unmasked.assign(kDimension, 0);
  for (uint32_t u : included) ESTUARY_RETURN_IF_ERROR(AddInto(outcome.unmasked, sites[u].masked, kConfig.bits));
  outcome.masked_sum = outcome.unmasked;

  // Unmasking: each responding site opens its neighbours' envelopes and
  // hands back, per neighbour, the share of b_u (u included) or of sk_u
  // (u never sent) — never both.
  std::map<uint32_t, std::vector<Share>> seed_shares_for, key_shares_for;
  for (uint32_t v : included) {
    if (scenario.silent_in_unmasking.contains(v)) continue;
    for (uint32_t u : graph.Neighbours(v)) {
      ESTUARY_ASSIGN_OR_RETURN(Key32 key, AgreeRoundKey(sites[v].share_keys.private_key, sites[u].share_keys.public_key,
                                                        kShareKeyLabel, kRound));
      const EnvelopeContext context{.sender = u, .receiver = v, .round = kRound};
      ESTUARY_ASSIGN_OR_RETURN(std::vector<uint8_t> payload, Open(key, context, mailbox.at(std::pair(u, v))));
      Share share{.x = v + 1};
      const size_t from = included.contains(u) ? 0 : kShareValueBytes;
      std::copy_n(payload.begin() + from, kShareValueBytes, share.y.begin());
      (included.contains(u) ? seed_shares_for : key_shares_for)[u].push_back(share);
    }
  }
  for (size_t c = 0; c + 1 < kChunkCuts.size(); ++c) {
    const size_t offset = kChunkCuts[c];
    const std::span<uint32_t> chunk = std::span(outcome.unmasked).subspan(offset, kChunkCuts[c + 1] - offset);
    for (uint32_t u : included) {
      ESTUARY_ASSIGN_OR_RETURN(Key32 seed, Combine(seed_shares_for[u], threshold, seed_commitment.at(u)));
      ESTUARY_RETURN_IF_ERROR(RemoveSelfMask(seed, kConfig.bits, offset, chunk));
    }
    for (uint32_t d : scenario.never_sent) {
      ESTUARY_ASSIGN_OR_RETURN(Key32 private_key, Combine(key_shares_for[d], threshold, key_commitment.at(d)));
      std::vector<PeerPublicKey> survivors;
      for (uint32_t v : graph.Neighbours(d)) {
        if (included.contains(v)) survivors.push_back({v, sites[v].mask_keys.public_key});
      }
      ESTUARY_RETURN_IF_ERROR(RemoveDroppedSiteMasks(d, private_key, survivors, kRound, kConfig.bits, offset, chunk));
    }
  }

  // What the answer must be: the same quantised vectors summed in the clear.
  outcome.plaintext_sum.assign(kDimension, 0);
  outcome.float_mean.assign(kDimension, 0);
  double total_weight = 0;
  std::vector<double> weights;
  for (uint32_t u : included) {
    ESTUARY_RETURN_IF_ERROR(AddInto(outcome.plaintext_sum, sites[u].quantized, kConfig.bits));
    ESTUARY_ASSIGN_OR_RETURN(std::vector<double> clipped, ClipToNorm(sites[u].update, kConfig.clip_norm));
    for (size_t i = 0; i < kDimension; ++i) outcome.float_mean[i] += sites[u].weight * clipped[i];
    total_weight += sites[u].weight;
    weights.push_back(sites[u].weight);
  }
  ESTUARY_RETURN_IF_ERROR(CheckNoOverflow(weights, kConfig));
  for (double& x : outcome.float_mean) x /= total_weight;
  ESTUARY_ASSIGN_OR_RETURN(outcome.dequantized, Dequantize(outcome.unmasked, total_weight, kConfig));
  outcome.bound = DequantizationErrorBound(static_cast<int>(included.size()), total_weight, kConfig);
  return outcome;
}

void ExpectExactSum(const Scenario& scenario) {
  auto outcome = RunRound(scenario);
  ASSERT_TRUE(outcome.ok()) << outcome.status().ToString();
  EXPECT_EQ(outcome->unmasked, outcome->plaintext_sum);
  double worst = 0;
  for (size_t i = 0; i < kDimension; ++i) {
    worst = std::max(worst, std::abs(outcome->dequantized[i] - outcome->float_mean[i]));
  }
  EXPECT_LE(worst, outcome->bound);
  EXPECT_GT(worst, 0);  // quantisation did lose something: the comparison is not of equal inputs
}

TEST(EndToEnd, TenSitesNoneDropped) { ExpectExactSum({.sites = 10, .degree = 9}); }
TEST(EndToEnd, TenSitesOneDropped) { ExpectExactSum({.sites = 10, .degree = 9, .never_sent = {4}}); }
TEST(EndToEnd, TenSitesThreeDropped) { ExpectExactSum({.sites = 10, .degree = 9, .never_sent = {0, 5, 9}}); }

// Whether every site keeps at least t responding neighbours: those not in
// `absent` (sites that never sent or went silent).
bool EnoughHoldersRemain(const NeighbourGraph& graph, const std::set<uint32_t>& absent) {
  for (int u = 0; u < graph.sites(); ++u) {
    int answering = 0;
    for (uint32_t v : graph.Neighbours(u)) answering += !absent.contains(v);
    if (answering < DefaultThreshold(graph.degree())) return false;
  }
  return true;
}

TEST(EndToEnd, SparseGraphWithDroppedAndSilentSites) {
  // k = 4, t = 3: a dropped site's masks are cancelled from 3 of its 4
  // neighbours' shares; a silent site's self mask from its neighbours'.
  auto graph = NeighbourGraph::Harary(10, 4, testing::CountingKey(99));
  ASSERT_TRUE(graph.ok());
  ExpectExactSum({.sites = 10, .degree = 4, .never_sent = {2}});
  // A silent site that shares no neighbour with site 2, so every site keeps
  // three answering neighbours.
  int silent = -1;
  for (uint32_t s = 0; s < 10 && silent < 0; ++s) {
    if (s != 2 && EnoughHoldersRemain(*graph, {2, s})) silent = static_cast<int>(s);
  }
  ASSERT_GE(silent, 0);
  ExpectExactSum({.sites = 10, .degree = 4, .never_sent = {2}, .silent_in_unmasking = {uint32_t(silent)}});

  // n = 20, k = 6, t = 4: three dropped sites, no two of them neighbours of
  // one site more than twice over (checked, so the scenario is what it says).
  auto wide = NeighbourGraph::Harary(20, 6, testing::CountingKey(99));
  ASSERT_TRUE(wide.ok());
  std::set<uint32_t> dropped;
  for (uint32_t s = 0; s < 20 && dropped.size() < 3; ++s) {
    std::set<uint32_t> trial = dropped;
    trial.insert(s);
    if (EnoughHoldersRemain(*wide, trial)) dropped = trial;
  }
  ASSERT_EQ(dropped.size(), 3u);
  ExpectExactSum({.sites = 20, .degree = 6, .never_sent = dropped});
}

TEST(EndToEnd, TheSumIsMaskedUntilTheCorrections) {
  // Before the server removes the self masks (and a dropped site's pairwise
  // masks) the sum of what arrived matches the plaintext sum nowhere but by
  // chance (2^-24 per element).
  for (const Scenario& scenario : {Scenario{.sites = 10, .degree = 9}, Scenario{.sites = 10, .degree = 9, .never_sent = {3}}}) {
    auto outcome = RunRound(scenario);
    ASSERT_TRUE(outcome.ok()) << outcome.status().ToString();
    size_t equal = 0;
    for (size_t i = 0; i < kDimension; ++i) equal += outcome->masked_sum[i] == outcome->plaintext_sum[i];
    EXPECT_LT(equal, 3u);
    EXPECT_EQ(outcome->unmasked, outcome->plaintext_sum);
  }
}

TEST(EndToEnd, TooFewSurvivingNeighboursIsAnErrorNotAWrongSum) {
  // With k = 4 and t = 3, a site of which two neighbours never sent has only
  // two holders left to answer for its self mask.
  auto graph = NeighbourGraph::Harary(10, 4, testing::CountingKey(99));
  ASSERT_TRUE(graph.ok());
  const auto& around = graph->Neighbours(0);
  auto outcome = RunRound({.sites = 10, .degree = 4, .never_sent = {around[0], around[1]}});
  ASSERT_FALSE(outcome.ok());
  EXPECT_EQ(outcome.status().code(), Code::kFailedPrecondition) << outcome.status().ToString();
  EXPECT_NE(outcome.status().message().find("too few to reconstruct"), std::string::npos);
}

}  // namespace
}  // namespace estuary::secagg
