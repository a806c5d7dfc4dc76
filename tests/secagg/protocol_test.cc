// The SecAgg+ state machines (secagg/client.h, secagg/server.h) driven
// through their four rounds by a relay in this file, with sites dropping out
// at each stage: the server's output must be the plain sum of the included
// sites' quantised inputs, bit for bit. And the refusals: too few sites, a
// request for both secrets of one peer, a tampered envelope, malformed or
// repeated messages.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <set>

#include "secagg/client.h"
#include "secagg/masking.h"
#include "secagg/quantize.h"
#include "secagg/server.h"
#include "tests/secagg/test_util.h"

namespace estuary::secagg {
namespace {

constexpr uint64_t kRound = 17;
constexpr uint64_t kDimension = 10'007;  // not a whole number of AES blocks (4 words)
constexpr int kBits = 24;

// When a site stops sending: the last message it sends is the one named.
// kMidMaskedInput: it streams part of its masked input — chunks the server
// adds into the sum as they arrive — and stops; the server withdraws them.
enum class Drop { kNone, kBeforeAdvertise, kAfterAdvertise, kAfterShare, kMidMaskedInput, kAfterMaskedInput };

ProtocolConfig Config(uint32_t sites, int degree, int threshold) {
  return {.round = kRound, .sites = sites, .degree = degree, .threshold = threshold, .bits = kBits,
          .dimension = kDimension, .graph_seed = testing::CountingKey(99)};
}

// Site u's quantised update: Quantize of a seeded Gaussian vector.
std::vector<uint32_t> InputOf(uint32_t u) {
  std::mt19937 data(1000 + u);  // test data only; nothing secret comes from it
  std::normal_distribution<float> normal(0.0f, 0.01f);
  std::vector<float> update(kDimension);
  for (float& x : update) x = normal(data);
  auto q = Quantize(update, 10.0 * (u + 1), {.bits = kBits, .clip_norm = 1.0, .scale = 1000},
                    testing::CountingKey(uint8_t(u)));
  EXPECT_TRUE(q.ok()) << q.status().ToString();
  return q.ok() ? *q : std::vector<uint32_t>();
}

struct Outcome {
  AggregateOutput output;
  std::vector<uint32_t> expected;  // the plain sum over the sites that should be included
  std::set<uint32_t> expected_included, expected_dropped;
  std::map<uint32_t, MaskedInput> masked;
};

Result<Outcome> RunProtocol(const ProtocolConfig& config, const std::map<uint32_t, Drop>& drops) {
  auto drop = [&](uint32_t u) { return drops.contains(u) ? drops.at(u) : Drop::kNone; };
  ESTUARY_ASSIGN_OR_RETURN(SecAggServer server, SecAggServer::Create(config));
  std::map<uint32_t, SecAggClient> clients;
  for (uint32_t u = 0; u < config.sites; ++u) {
    ESTUARY_ASSIGN_OR_RETURN(SecAggClient client, SecAggClient::Create(config, u));
    clients.emplace(u, std::move(client));
  }
  for (auto& [u, client] : clients) {
    if (drop(u) == Drop::kBeforeAdvertise) continue;
    ESTUARY_ASSIGN_OR_RETURN(AdvertiseKeys keys, client.Advertise());
    ESTUARY_RETURN_IF_ERROR(server.Receive(keys));
  }
  ESTUARY_ASSIGN_OR_RETURN(auto broadcasts, server.CloseAdvertise());
  for (auto& [u, broadcast] : broadcasts) {
    if (drop(u) == Drop::kAfterAdvertise) continue;
    ESTUARY_ASSIGN_OR_RETURN(ShareKeys shares, clients.at(u).Share(broadcast));
    ESTUARY_RETURN_IF_ERROR(server.Receive(shares));
  }
  ESTUARY_ASSIGN_OR_RETURN(auto inboxes, server.CloseShareKeys());
  Outcome outcome;
  outcome.expected.assign(kDimension, 0);
  // The sites that stop partway go first, so that the others' inputs are
  // added on top of their chunks before they are withdrawn.
  std::map<uint32_t, std::vector<uint32_t>> partial;  // the server's copy of what each added
  for (auto& [u, inbox] : inboxes) {
    if (drop(u) != Drop::kMidMaskedInput) continue;
    std::vector<uint32_t> input = InputOf(u);
    ESTUARY_RETURN_IF_ERROR(clients.at(u).BeginMaskedInput(inbox));
    // Three uneven chunks, 6,000 of the 10,007 elements, then nothing more.
    for (auto [at, n] : {std::pair<uint64_t, uint64_t>{0, 1000}, {1000, 2333}, {3333, 2667}}) {
      std::span<uint32_t> chunk = std::span(input).subspan(at, n);
      ESTUARY_RETURN_IF_ERROR(clients.at(u).MaskChunk(at, chunk));
      ESTUARY_RETURN_IF_ERROR(server.ReceiveMaskedChunk(u, at, chunk));
      partial[u].insert(partial[u].end(), chunk.begin(), chunk.end());
    }
    outcome.expected_dropped.insert(u);
  }
  for (auto& [u, inbox] : inboxes) {
    if (drop(u) == Drop::kMidMaskedInput) continue;
    if (drop(u) == Drop::kAfterShare) {
      outcome.expected_dropped.insert(u);
      continue;
    }
    const std::vector<uint32_t> input = InputOf(u);
    ESTUARY_ASSIGN_OR_RETURN(MaskedInput masked, clients.at(u).MaskInput(inbox, input));
    outcome.masked[u] = masked;
    ESTUARY_RETURN_IF_ERROR(server.Receive(masked));
    ESTUARY_RETURN_IF_ERROR(AddInto(outcome.expected, input, kBits));
    outcome.expected_included.insert(u);
  }
  for (const auto& [u, copy] : partial) {
    if (server.CloseMaskedInput().ok()) return Internal("the stage closed with site {}'s input partly in the sum", u);
    // Read back in other pieces than it arrived in: the masking is additive, so any cut subtracts the same.
    ESTUARY_RETURN_IF_ERROR(server.WithdrawMaskedInput(
        u,
        [&copy](uint64_t offset, std::span<uint32_t> values) {
          std::copy_n(copy.begin() + int64_t(offset), values.size(), values.begin());
          return Status::Ok();
        },
        777));
  }
  ESTUARY_ASSIGN_OR_RETURN(SurvivorSet survivors, server.CloseMaskedInput());
  for (uint32_t u : survivors.survived) {
    if (drop(u) == Drop::kAfterMaskedInput) continue;
    ESTUARY_ASSIGN_OR_RETURN(std::string confirmed, clients.at(u).ConfirmSurvivors(survivors));
    ESTUARY_RETURN_IF_ERROR(server.Receive(SurvivorsSigned{u, UnauthenticatedSignature(confirmed)}));
  }
  ESTUARY_ASSIGN_OR_RETURN(auto requests, server.CloseConsistency());
  for (const auto& [u, request] : requests) {
    ESTUARY_ASSIGN_OR_RETURN(UnmaskResponse response, clients.at(u).Unmask(request, UnauthenticatedSurvivorsCheck));
    ESTUARY_RETURN_IF_ERROR(server.Receive(response));
  }
  ESTUARY_ASSIGN_OR_RETURN(outcome.output, server.Finish());
  return outcome;
}

void ExpectExactSum(const ProtocolConfig& config, const std::map<uint32_t, Drop>& drops) {
  auto outcome = RunProtocol(config, drops);
  ASSERT_TRUE(outcome.ok()) << outcome.status().ToString();
  EXPECT_EQ(outcome->output.sum, outcome->expected);
  EXPECT_EQ(std::set<uint32_t>(outcome->output.included.begin(), outcome->output.included.end()),
            outcome->expected_included);
  EXPECT_EQ(std::set<uint32_t>(outcome->output.dropped.begin(), outcome->output.dropped.end()),
            outcome->expected_dropped);
  // The sum is not trivially zero or one site's input.
  EXPECT_NE(outcome->expected, std::vector<uint32_t>(kDimension, 0));
}

// n = 10, k = 4 (t = 3): a sparse graph, not plain SecAgg's complete one.
TEST(Protocol, TenSitesSparseGraphNoDropout) {
  ExpectExactSum(Config(10, 4, 3), {});
  ExpectExactSum(Config(10, 6, 4), {});
}

TEST(Protocol, DropoutAfterAdvertise) { ExpectExactSum(Config(10, 4, 3), {{6, Drop::kAfterAdvertise}}); }
TEST(Protocol, DropoutBeforeAdvertise) { ExpectExactSum(Config(10, 4, 3), {{1, Drop::kBeforeAdvertise}}); }

TEST(Protocol, DropoutAfterShareKeysNeedsTheMaskKeyReconstructed) {
  // Site 2's neighbours masked with it, then its input never came: the
  // server cancels their pairwise masks from sk_2, rebuilt from 3 shares.
  ExpectExactSum(Config(10, 4, 3), {{2, Drop::kAfterShare}});
}

TEST(Protocol, DropoutMidMaskedInputIsWithdrawnFromTheSum) {
  // Site 4 streamed 6,000 of its 10,007 masked elements into the sum, then
  // stopped: the server subtracts them again from its copy, and site 4 is a
  // dropout of the masked input stage (its mask key rebuilt, its neighbours'
  // pairwise masks cancelled); the sum is the others' inputs, bit for bit.
  ExpectExactSum(Config(10, 4, 3), {{4, Drop::kMidMaskedInput}});
  ExpectExactSum(Config(10, 8, 5), {{4, Drop::kMidMaskedInput}, {7, Drop::kMidMaskedInput}, {2, Drop::kAfterShare}});
}

// The streaming receive's own checks: chunks in order and within the
// dimension, a stage that will not close over a partial input, and a copy
// read back that is not what was added, which loses the sum: the stage fails.
TEST(Protocol, AStreamedMaskedInputIsCheckedAndAWrongCopyFailsTheStage) {
  const ProtocolConfig config = Config(4, 3, 2);
  auto server = SecAggServer::Create(config);
  ASSERT_TRUE(server.ok());
  std::map<uint32_t, SecAggClient> clients;
  for (uint32_t u = 0; u < 4; ++u) {
    auto client = SecAggClient::Create(config, u);
    ASSERT_TRUE(client.ok());
    auto keys = client->Advertise();
    ASSERT_TRUE(keys.ok() && server->Receive(*keys).ok());
    clients.emplace(u, std::move(*client));
  }
  auto broadcasts = server->CloseAdvertise();
  ASSERT_TRUE(broadcasts.ok());
  for (auto& [u, client] : clients) {
    auto shares = client.Share(broadcasts->at(u));
    ASSERT_TRUE(shares.ok() && server->Receive(*shares).ok());
  }
  ASSERT_TRUE(server->CloseShareKeys().ok());
  const std::vector<uint32_t> chunk(100, 5);
  EXPECT_EQ(server->ReceiveMaskedChunk(0, 100, chunk).message(),
            "secagg round 17: masked input from site 0: a chunk of 100 elements at element 100, expected the next of "
            "10007 at 0");
  ASSERT_TRUE(server->ReceiveMaskedChunk(0, 0, chunk).ok());
  EXPECT_TRUE(server->PartlyReceived(0));
  EXPECT_EQ(server->FinishMaskedInput(0).message(),
            "secagg round 17: masked input from site 0 ends after 100 of 10007 elements");
  EXPECT_EQ(server->ReceiveMaskedChunk(0, 100, std::vector<uint32_t>(kDimension, 1)).message(),
            "secagg round 17: masked input from site 0: a chunk of 10007 elements at element 100, expected the next "
            "of 10007 at 100");
  EXPECT_EQ(server->CloseMaskedInput().status().message(),
            "secagg round 17: masked input: site 0's input is partly in the sum (100 of 10007 elements): it must "
            "finish or be withdrawn before the stage closes");
  EXPECT_EQ(server->WithdrawMaskedInput(1, [](uint64_t, std::span<uint32_t>) { return Status::Ok(); }).message(),
            "secagg round 17: withdrawing site 1's masked input, which is not partly in the sum");
  const Status wrong = server->WithdrawMaskedInput(0, [](uint64_t, std::span<uint32_t> values) {
    std::fill(values.begin(), values.end(), 6u);  // not the 5s that were added
    return Status::Ok();
  });
  EXPECT_EQ(wrong.message(),
            "secagg round 17: masked input: withdrawing site 0's 100 elements: the copy read back is not what was "
            "added: the sum is lost");
  EXPECT_FALSE(server->CloseMaskedInput().ok()) << "a lost sum must never be released";
  // A withdrawn site is silent from then on.
  EXPECT_FALSE(server->ReceiveMaskedChunk(0, 0, chunk).ok());
}

TEST(Protocol, DropoutAfterMaskedInputIsStillSummed) {
  // Site 5's input arrived; it never answers the unmasking: its self mask is
  // removed from its neighbours' shares of b_5.
  ExpectExactSum(Config(10, 4, 3), {{5, Drop::kAfterMaskedInput}});
}

// `count` sites such that every site keeps t answering neighbours when they
// all go: each loses at most k − t of its k.
std::vector<uint32_t> DroppableSites(const ProtocolConfig& config, size_t count) {
  auto graph = NeighbourGraph::Harary(int(config.sites), config.degree, config.graph_seed);
  EXPECT_TRUE(graph.ok());
  std::vector<uint32_t> chosen;
  for (uint32_t s = 0; s < config.sites && chosen.size() < count; ++s) {
    std::vector<uint32_t> trial = chosen;
    trial.push_back(s);
    bool ok = true;
    for (uint32_t u = 0; u < config.sites; ++u) {
      int missing = 0;
      for (uint32_t v : graph->Neighbours(u)) missing += int(std::count(trial.begin(), trial.end(), v));
      ok = ok && missing <= config.degree - config.threshold;
    }
    if (ok) chosen = trial;
  }
  EXPECT_EQ(chosen.size(), count);
  return chosen;
}

TEST(Protocol, DropoutsAtEveryStageTogether) {
  // n = 10, k = 8, t = 5: one site after each of the three sending stages.
  const ProtocolConfig ten = Config(10, 8, 5);
  std::vector<uint32_t> chosen = DroppableSites(ten, 3);
  ASSERT_EQ(chosen.size(), 3u);
  ExpectExactSum(ten, {{chosen[0], Drop::kAfterAdvertise},
                       {chosen[1], Drop::kAfterShare},
                       {chosen[2], Drop::kAfterMaskedInput}});
  // n = 20, k = 8, t = 5: one at each of the four stages.
  const ProtocolConfig twenty = Config(20, 8, 5);
  chosen = DroppableSites(twenty, 4);
  ASSERT_EQ(chosen.size(), 4u);
  std::map<uint32_t, Drop> drops;
  for (size_t i = 0; i < chosen.size(); ++i) drops[chosen[i]] = Drop(1 + i % 4);
  ExpectExactSum(twenty, drops);
}

TEST(Protocol, CompleteGraphWithThreeDropped) {
  ExpectExactSum(Config(10, 9, 5), {{0, Drop::kAfterShare}, {4, Drop::kAfterShare}, {9, Drop::kAfterMaskedInput}});
}

// Byte-frequency chi-square over the top 8 of the 24 bits (255 degrees of
// freedom; 330.5 is the critical value at α = 0.001).
double TopByteChiSquare(const std::vector<uint32_t>& values) {
  std::vector<double> counts(256, 0);
  for (uint32_t v : values) counts[(v >> (kBits - 8)) & 0xff] += 1;
  const double expected = double(values.size()) / 256;
  double chi = 0;
  for (double c : counts) chi += (c - expected) * (c - expected) / expected;
  return chi;
}

TEST(Protocol, AMaskedInputLooksUniformAndUncorrelatedWithTheInput) {
  auto outcome = RunProtocol(Config(10, 4, 3), {});
  ASSERT_TRUE(outcome.ok()) << outcome.status().ToString();
  const std::vector<uint32_t> input = InputOf(3);
  const std::vector<uint32_t>& masked = outcome->masked.at(3).values;
  ASSERT_EQ(masked.size(), input.size());
  EXPECT_LT(TopByteChiSquare(masked), 330.5);
  EXPECT_GT(TopByteChiSquare(input), 10 * 330.5);  // the input itself is far from uniform
  // Pearson correlation of the signed input with the masked value.
  double sx = 0, sy = 0, sxx = 0, syy = 0, sxy = 0;
  const double n = double(input.size());
  for (size_t i = 0; i < input.size(); ++i) {
    const double x = input[i] >= (1u << (kBits - 1)) ? double(input[i]) - double(1u << kBits) : double(input[i]);
    const double y = masked[i];
    sx += x, sy += y, sxx += x * x, syy += y * y, sxy += x * y;
  }
  const double r = (sxy - sx * sy / n) / std::sqrt((sxx - sx * sx / n) * (syy - sy * sy / n));
  EXPECT_LT(std::abs(r), 5 / std::sqrt(n)) << "5 standard errors of a zero correlation";
}

TEST(Protocol, FewerThanThresholdSurvivorsIsRefusedWithOneLine) {
  // Complete graph, t = 5: six sites gone after sharing leave four inputs.
  std::map<uint32_t, Drop> drops;
  for (uint32_t u : {0, 1, 2, 3, 4, 5}) drops[u] = Drop::kAfterShare;
  auto outcome = RunProtocol(Config(10, 9, 5), drops);
  ASSERT_FALSE(outcome.ok());
  EXPECT_EQ(outcome.status().code(), Code::kFailedPrecondition);
  EXPECT_EQ(outcome.status().message(),
            "secagg round 17: masked input: 4 of 10 sites remain, fewer than the threshold 5: refusing to proceed");

  // At the first stage too.
  drops.clear();
  for (uint32_t u = 0; u < 6; ++u) drops[u] = Drop::kBeforeAdvertise;
  outcome = RunProtocol(Config(10, 9, 5), drops);
  ASSERT_FALSE(outcome.ok());
  EXPECT_EQ(outcome.status().message(),
            "secagg round 17: advertise keys: 4 of 10 sites remain, fewer than the threshold 5: refusing to proceed");

  // Enough sites overall, but site 0 keeps only two of its four neighbours:
  // its own secrets could never be rebuilt, so it refuses to share.
  auto graph = NeighbourGraph::Harary(10, 4, testing::CountingKey(99));
  ASSERT_TRUE(graph.ok());
  drops.clear();
  drops[graph->Neighbours(0)[0]] = Drop::kBeforeAdvertise;
  drops[graph->Neighbours(0)[1]] = Drop::kBeforeAdvertise;
  outcome = RunProtocol(Config(10, 4, 3), drops);
  ASSERT_FALSE(outcome.ok());
  EXPECT_EQ(outcome.status().message(),
            "secagg site 0: round 17: share keys: 2 of 4 neighbours advertised keys, fewer than the threshold 3");
}

// Drives sites 0..9 (k = 4, t = 3) to the consistency check (`survivors`)
// or through it to the unmasking stage (`requests`), none dropped.
struct AtUnmasking {
  SecAggServer server;
  std::map<uint32_t, SecAggClient> clients;
  std::map<uint32_t, ShareInbox> inboxes;
  SurvivorSet survivors;
  std::map<uint32_t, std::string> confirmed;
  std::map<uint32_t, UnmaskRequest> requests;
};

Result<AtUnmasking> DriveToConsistency() {
  const ProtocolConfig config = Config(10, 4, 3);
  ESTUARY_ASSIGN_OR_RETURN(SecAggServer server, SecAggServer::Create(config));
  AtUnmasking at{.server = std::move(server)};
  for (uint32_t u = 0; u < 10; ++u) {
    ESTUARY_ASSIGN_OR_RETURN(SecAggClient client, SecAggClient::Create(config, u));
    ESTUARY_ASSIGN_OR_RETURN(AdvertiseKeys keys, client.Advertise());
    ESTUARY_RETURN_IF_ERROR(at.server.Receive(keys));
    at.clients.emplace(u, std::move(client));
  }
  ESTUARY_ASSIGN_OR_RETURN(auto broadcasts, at.server.CloseAdvertise());
  for (auto& [u, client] : at.clients) {
    ESTUARY_ASSIGN_OR_RETURN(ShareKeys shares, client.Share(broadcasts.at(u)));
    ESTUARY_RETURN_IF_ERROR(at.server.Receive(shares));
  }
  ESTUARY_ASSIGN_OR_RETURN(at.inboxes, at.server.CloseShareKeys());
  for (auto& [u, client] : at.clients) {
    ESTUARY_ASSIGN_OR_RETURN(MaskedInput masked, client.MaskInput(at.inboxes.at(u), InputOf(u)));
    ESTUARY_RETURN_IF_ERROR(at.server.Receive(masked));
  }
  ESTUARY_ASSIGN_OR_RETURN(at.survivors, at.server.CloseMaskedInput());
  return at;
}

Result<AtUnmasking> DriveToUnmasking() {
  ESTUARY_ASSIGN_OR_RETURN(AtUnmasking at, DriveToConsistency());
  for (auto& [u, client] : at.clients) {
    ESTUARY_ASSIGN_OR_RETURN(at.confirmed[u], client.ConfirmSurvivors(at.survivors));
    ESTUARY_RETURN_IF_ERROR(at.server.Receive(SurvivorsSigned{u, UnauthenticatedSignature(at.confirmed[u])}));
  }
  ESTUARY_ASSIGN_OR_RETURN(at.requests, at.server.CloseConsistency());
  return at;
}

TEST(Protocol, ASiteRevealsOneSecretPerPeerByTheSetItSignedAndAnswersOnce) {
  auto at = DriveToUnmasking();
  ASSERT_TRUE(at.ok()) << at.status().ToString();
  SecAggClient& site = at->clients.at(0);
  // The request names no set: all 10 survived, as site 0 signed, so it reveals
  // a self-mask share of each neighbour and no key share.
  auto response = site.Unmask(at->requests.at(0), UnauthenticatedSurvivorsCheck);
  ASSERT_TRUE(response.ok()) << response.status().ToString();
  std::set<uint32_t> seeds;
  for (const PeerShare& share : response->seed_shares) seeds.insert(share.peer);
  const std::vector<uint32_t> neighbours = site.neighbours().ids();
  EXPECT_EQ(seeds, std::set<uint32_t>(neighbours.begin(), neighbours.end()));
  EXPECT_TRUE(response->key_shares.empty());
  // It answers once: a second request, however signed, gets nothing.
  response = site.Unmask(at->requests.at(0), UnauthenticatedSurvivorsCheck);
  ASSERT_FALSE(response.ok());
  EXPECT_EQ(response.status().message(), "secagg site 0: round 17: unmasking called in stage done");
}

// A neighbour x outside the U3 a site signed (its input never arrived, as the
// site was told) gets its key share revealed, and only that; the others in U3
// their self-mask shares.
TEST(Protocol, ASiteRevealsTheKeyShareOfANeighbourOutsideTheSetItSigned) {
  auto at = DriveToConsistency();
  ASSERT_TRUE(at.ok()) << at.status().ToString();
  const std::vector<uint32_t> neighbours = at->clients.at(0).neighbours().ids();
  const uint32_t x = neighbours[0];
  SurvivorSet without_x;
  for (uint32_t u : at->survivors.survived) {
    if (u != x) without_x.survived.push_back(u);
  }
  std::map<uint32_t, std::string> confirmed;
  for (auto& [u, client] : at->clients) {
    if (u == x) continue;
    auto message = client.ConfirmSurvivors(without_x);
    ASSERT_TRUE(message.ok()) << message.status().ToString();
    confirmed[u] = *message;
  }
  UnmaskRequest request;
  for (uint32_t v : neighbours) {
    if (v != x) request.signatures.push_back({v, UnauthenticatedSignature(confirmed.at(v))});
  }
  auto response = at->clients.at(0).Unmask(request, UnauthenticatedSurvivorsCheck);
  ASSERT_TRUE(response.ok()) << response.status().ToString();
  std::set<uint32_t> seeds, keys;
  for (const PeerShare& share : response->seed_shares) seeds.insert(share.peer);
  for (const PeerShare& share : response->key_shares) keys.insert(share.peer);
  EXPECT_EQ(seeds, std::set<uint32_t>(neighbours.begin() + 1, neighbours.end()));
  EXPECT_EQ(keys, std::set<uint32_t>{x});
}

TEST(Protocol, ATamperedEnvelopeIsRefused) {
  const ProtocolConfig config = Config(10, 4, 3);
  auto server = SecAggServer::Create(config);
  ASSERT_TRUE(server.ok());
  std::map<uint32_t, SecAggClient> clients;
  for (uint32_t u = 0; u < 10; ++u) {
    auto client = SecAggClient::Create(config, u);
    ASSERT_TRUE(client.ok());
    auto keys = client->Advertise();
    ASSERT_TRUE(keys.ok());
    ASSERT_TRUE(server->Receive(*keys).ok());
    clients.emplace(u, std::move(*client));
  }
  auto broadcasts = server->CloseAdvertise();
  ASSERT_TRUE(broadcasts.ok());
  for (auto& [u, client] : clients) {
    auto shares = client.Share(broadcasts->at(u));
    ASSERT_TRUE(shares.ok()) << shares.status().ToString();
    if (u == 4) {
      // The server refuses an envelope of the wrong size, and keeps nothing of it.
      ShareKeys short_one = *shares;
      short_one.envelopes[0].envelope.pop_back();
      const Status refused = server->Receive(short_one);
      EXPECT_EQ(refused.message(), fmt::format("secagg round 17: share keys from site 4: envelope for site {} of 159 "
                                               "bytes, expected 160",
                                               short_one.envelopes[0].peer));
    }
    ASSERT_TRUE(server->Receive(*shares).ok());
    EXPECT_FALSE(server->Receive(*shares).ok()) << "a second share keys from one site";
  }
  auto inboxes = server->CloseShareKeys();
  ASSERT_TRUE(inboxes.ok());
  ShareInbox inbox = inboxes->at(7);
  const uint32_t sender = inbox.envelopes[1].peer;
  inbox.envelopes[1].envelope[40] ^= 0x01;
  auto masked = clients.at(7).MaskInput(inbox, InputOf(7));
  ASSERT_FALSE(masked.ok());
  EXPECT_EQ(masked.status().code(), Code::kProtocol);
  EXPECT_NE(masked.status().message().find(
                fmt::format("secagg site 7: round 17: masked input: envelope from site {} refused", sender)),
            std::string::npos)
      << masked.status().message();
  // An envelope relayed to the wrong site fails the tag as well.
  auto masked8 = clients.at(8).MaskInput(ShareInbox{{{inboxes->at(9).envelopes[0].peer,
                                                      inboxes->at(9).envelopes[0].envelope}}},
                                         InputOf(8));
  EXPECT_FALSE(masked8.ok());
}

TEST(Protocol, MalformedMessagesAreRefusedAndChangeNothing) {
  auto at = DriveToUnmasking();
  ASSERT_TRUE(at.ok()) << at.status().ToString();
  // Late, repeated or from outside: refused with the stage or the set named.
  EXPECT_EQ(at->server.Receive(MaskedInput{.site = 3, .values = InputOf(3)}).message(),
            "secagg round 17: masked input from site 3 during stage unmasking");
  EXPECT_EQ(at->server.Receive(AdvertiseKeys{.site = 3}).message(),
            "secagg round 17: advertised keys from site 3 during stage unmasking");
  EXPECT_EQ(at->server.Receive(UnmaskResponse{.site = 12}).message(),
            "secagg round 17: unmasking response from site 12, not among the 10 sites");
  // A share of a survived site offered as a mask-key share.
  auto response = at->clients.at(2).Unmask(at->requests.at(2), UnauthenticatedSurvivorsCheck);
  ASSERT_TRUE(response.ok());
  UnmaskResponse wrong = *response;
  wrong.key_shares.push_back(wrong.seed_shares.back());
  wrong.seed_shares.pop_back();
  EXPECT_EQ(at->server.Receive(wrong).message(),
            fmt::format("secagg round 17: unmasking response from site 2: a mask key share of site {}, which survived",
                        wrong.key_shares.back().peer));
  // A share of a site that is not its neighbour.
  UnmaskResponse stranger = *response;
  uint32_t far = 0;
  while (far == 2 || at->clients.at(2).neighbours().Contains(far)) ++far;
  stranger.seed_shares[0].peer = far;
  EXPECT_EQ(at->server.Receive(stranger).message(),
            fmt::format("secagg round 17: unmasking response from site 2: a share of site {}, whose shares it does not "
                        "hold",
                        far));
  ASSERT_TRUE(at->server.Receive(*response).ok());
  EXPECT_EQ(at->server.Receive(*response).message(), "secagg round 17: a second unmasking response from site 2");
  // The refusals left nothing behind: the sum is still exact.
  std::vector<uint32_t> expected(kDimension, 0);
  for (uint32_t u = 0; u < 10; ++u) ASSERT_TRUE(AddInto(expected, InputOf(u), kBits).ok());
  for (auto& [u, client] : at->clients) {
    if (u == 2) continue;
    auto answer = client.Unmask(at->requests.at(u), UnauthenticatedSurvivorsCheck);
    ASSERT_TRUE(answer.ok()) << answer.status().ToString();
    ASSERT_TRUE(at->server.Receive(*answer).ok());
  }
  auto output = at->server.Finish();
  ASSERT_TRUE(output.ok()) << output.status().ToString();
  EXPECT_EQ(output->sum, expected);
}

// The consistency check (Bonawitz et al. §4). A server that tells site 0 one
// survivor set and its neighbours another — here that a non-neighbour x
// dropped, so as to ask them for sk_x while others reveal b_x — is refused
// by both sides, whichever signatures it relays.
TEST(Protocol, TwoSurvivorSetsAreRefusedByTheSitesOnBothSides) {
  auto at = DriveToConsistency();
  ASSERT_TRUE(at.ok()) << at.status().ToString();
  const NeighbourGraph& graph = at->server.graph();
  const SiteNeighbours& zeros = at->clients.at(0).neighbours();
  ASSERT_EQ(zeros.ids(), graph.Neighbours(0));
  uint32_t x = 1;
  while (zeros.Contains(x)) ++x;
  SurvivorSet without_x;
  for (uint32_t u : at->survivors.survived) {
    if (u != x) without_x.survived.push_back(u);
  }
  std::map<uint32_t, std::string> confirmed;
  for (auto& [u, client] : at->clients) {
    const bool told_other = zeros.Contains(u);
    auto message = client.ConfirmSurvivors(told_other ? without_x : at->survivors);
    ASSERT_TRUE(message.ok()) << message.status().ToString();
    confirmed[u] = *message;
  }
  EXPECT_NE(confirmed.at(0), confirmed.at(zeros.ids()[0]));
  // Site 0 with every neighbour's signature, as they signed.
  UnmaskRequest request;
  for (uint32_t v : zeros.ids()) request.signatures.push_back({v, UnauthenticatedSignature(confirmed.at(v))});
  auto response = at->clients.at(0).Unmask(request, UnauthenticatedSurvivorsCheck);
  ASSERT_FALSE(response.ok());
  EXPECT_EQ(response.status().message(),
            fmt::format("secagg site 0: round 17: unmasking: site {}'s signature on the survivor set refused: site {} "
                        "confirmed another survivor set",
                        zeros.ids()[0], zeros.ids()[0]));
  // A neighbour of site 0, asked for x's mask key: site 0's signature is over the other set.
  const uint32_t n0 = zeros.ids()[1];
  UnmaskRequest other;
  for (uint32_t v : graph.Neighbours(n0)) {
    if (v != x) other.signatures.push_back({v, UnauthenticatedSignature(confirmed.at(v))});
  }
  response = at->clients.at(n0).Unmask(other, UnauthenticatedSurvivorsCheck);
  ASSERT_FALSE(response.ok());
  EXPECT_NE(response.status().message().find("signature on the survivor set refused"), std::string::npos)
      << response.status().message();
  // Leaving out the signatures that disagree leaves site 0 short of t...
  const uint32_t n1 = zeros.ids()[2];
  auto honest_only = at->clients.at(n1).Unmask(UnmaskRequest{}, UnauthenticatedSurvivorsCheck);
  ASSERT_FALSE(honest_only.ok());
  EXPECT_EQ(honest_only.status().message(),
            fmt::format("secagg site {}: round 17: unmasking: 0 of its neighbours signed the survivor set, fewer than "
                        "the threshold 3: refusing to reveal its shares",
                        n1));
  // ...and signatures over the other set (the one site 0 signed, which names
  // x) are refused by a site that signed the set without x: it unmasks only
  // by the set it signed, so no request can make it reveal sk_x on t
  // signatures over a set in which x survived.
  const uint32_t n2 = graph.Neighbours(0)[3];
  UnmaskRequest forged;
  for (uint32_t v : graph.Neighbours(n2)) {
    if (v != x) forged.signatures.push_back({v, UnauthenticatedSignature(confirmed.at(0))});
  }
  response = at->clients.at(n2).Unmask(forged, UnauthenticatedSurvivorsCheck);
  ASSERT_FALSE(response.ok());
  EXPECT_NE(response.status().message().find("signature on the survivor set refused"), std::string::npos)
      << response.status().message();
}

TEST(Protocol, TooFewStrangeOrRepeatedSignaturesAreRefused) {
  auto at = DriveToUnmasking();
  ASSERT_TRUE(at.ok()) << at.status().ToString();
  auto refused = [&](uint32_t u, const UnmaskRequest& request) {
    auto response = at->clients.at(u).Unmask(request, UnauthenticatedSurvivorsCheck);
    EXPECT_FALSE(response.ok()) << "site " << u << " revealed its shares";
    return response.ok() ? std::string() : std::string(response.status().message());
  };
  // Two of its four neighbours' signatures, t = 3.
  UnmaskRequest two = at->requests.at(0);
  ASSERT_EQ(two.signatures.size(), 4u);
  two.signatures.resize(2);
  EXPECT_EQ(refused(0, two), "secagg site 0: round 17: unmasking: 2 of its neighbours signed the survivor set, fewer "
                             "than the threshold 3: refusing to reveal its shares");
  // A signature of a site that is not its neighbour (it would pad the count).
  UnmaskRequest padded = at->requests.at(1);
  padded.signatures.resize(2);
  uint32_t far = 0;
  while (far == 1 || at->clients.at(1).neighbours().Contains(far)) ++far;
  padded.signatures.push_back({far, UnauthenticatedSignature(at->confirmed.at(far))});
  EXPECT_EQ(refused(1, padded), fmt::format("secagg site 1: round 17: unmasking: a signature of site {}, not a "
                                            "neighbour in the survivor set",
                                            far));
  // One neighbour's signature twice.
  UnmaskRequest twice = at->requests.at(2);
  twice.signatures[2] = twice.signatures[1];
  EXPECT_EQ(refused(2, twice), fmt::format("secagg site 2: round 17: unmasking: two signatures of site {}",
                                           twice.signatures[1].site));
  // A signature over last round's set (the same sites, round 16).
  UnmaskRequest stale = at->requests.at(3);
  ProtocolConfig last_round = Config(10, 4, 3);
  last_round.round = 16;
  stale.signatures[0].signature = UnauthenticatedSignature(SurvivorsToSign(last_round, at->survivors.survived));
  EXPECT_NE(refused(3, stale).find(fmt::format("site {}'s signature on the survivor set refused",
                                               stale.signatures[0].site)),
            std::string::npos);
  // Each refused request ended its site's part: the honest one gets nothing now.
  EXPECT_EQ(refused(0, at->requests.at(0)), "secagg site 0: round 17: unmasking called in stage done");
}

TEST(Protocol, TheServerClosesTheConsistencyCheckBelowTheThreshold) {
  auto at = DriveToConsistency();
  ASSERT_TRUE(at.ok()) << at.status().ToString();
  for (uint32_t u : {0u, 1u}) {
    auto message = at->clients.at(u).ConfirmSurvivors(at->survivors);
    ASSERT_TRUE(message.ok());
    ASSERT_TRUE(at->server.Receive(SurvivorsSigned{u, UnauthenticatedSignature(*message)}).ok());
  }
  EXPECT_EQ(at->server.Receive(SurvivorsSigned{0, "again"}).message(),
            "secagg round 17: a second signed survivor set from site 0");
  EXPECT_EQ(at->server.Receive(SurvivorsSigned{3, ""}).message(),
            "secagg round 17: signed survivor set from site 3: a signature of 0 bytes, expected 1 to 1024");
  EXPECT_EQ(at->server.CloseConsistency().status().message(),
            "secagg round 17: consistency check: 2 of 10 sites remain, fewer than the threshold 3: refusing to proceed");
  // A site told a set without itself, or too small, refuses to sign it.
  auto site = at->clients.find(5);
  EXPECT_EQ(site->second.ConfirmSurvivors(SurvivorSet{{0, 1, 2}}).status().message(),
            "secagg site 5: round 17: consistency check: this site sent its masked input but is not listed as "
            "survived");
  EXPECT_EQ(at->clients.at(6).ConfirmSurvivors(SurvivorSet{{0, 6}}).status().message(),
            "secagg site 6: round 17: consistency check: 2 sites survived, fewer than the threshold 3");
}

TEST(Protocol, ClientChecksItsInputsAndOrder) {
  const ProtocolConfig config = Config(10, 4, 3);
  auto client = SecAggClient::Create(config, 0);
  ASSERT_TRUE(client.ok());
  EXPECT_EQ(client->Share({}).status().message(), "secagg site 0: round 17: share keys called in stage advertise keys");
  ASSERT_TRUE(client->Advertise().ok());
  auto other = SecAggClient::Create(config, 0);
  ASSERT_TRUE(other.ok());
  auto keys = other->Advertise();
  ASSERT_TRUE(keys.ok());
  keys->site = 0;
  EXPECT_EQ(client->Share({{*keys}}).status().message(), "secagg site 0: round 17: share keys: keys of this site itself");
  EXPECT_EQ(SecAggClient::Create(config, 10).status().message(), "secagg site 10: not among the 10 sites");
  EXPECT_EQ(SecAggClient::Create(Config(10, 4, 2), 0).status().message(),
            "secagg: threshold 2 with 4 neighbours: must be in [3, 4] (a strict majority)");
}

}  // namespace
}  // namespace estuary::secagg
