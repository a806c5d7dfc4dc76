// End-to-end: SecAgg+ over the federation's mutual-TLS sessions. The real
// estuary-server (--secagg) and estuary-client binaries as child processes on
// 127.0.0.1, and — for the sites that drop out at a chosen stage — scripted
// sites in this process that speak the same protocol over their own TLS
// connections and then abort them.
//
// The oracle: every site keeps the quantised input it masked
// (--secagg-keep-input); their plain sum mod 2^32, dequantised and folded by
// FedAvg into the previous global model, must be the committed model bit for
// bit — the masks cancel exactly or the test fails.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <regex>
#include <set>
#include <thread>

#include "aggregation/sampling.h"
#include "aggregation/strategy.h"
#include "client/secagg_site.h"
#include "crypto/sha256.h"
#include "models/checkpoint.h"
#include "privacy/accountant.h"
#include "privacy/distributed_dp.h"
#include "privacy/poisson_plan.h"
#include "secagg/quantize.h"
#include "secagg/wire.h"
#include "tests/e2e/federation.h"
#include "tests/e2e/harness.h"
#include "tests/secagg/kept_inputs.h"

namespace estuary::testing {
namespace {


std::vector<float> Checkpoint(server::Store& store, uint64_t round) {
  auto path = store.CheckpointFor(round);
  EXPECT_TRUE(path.ok() && path->has_value());
  auto checkpoint = models::LoadCheckpoint(**path);
  EXPECT_TRUE(checkpoint.ok());
  return checkpoint.ok() ? checkpoint->data : std::vector<float>{};
}

// A site in this process: takes round 1 over its own TLS connection with a
// known update, and aborts the connection after the stage it is told.
class ScriptedSite {
 public:
  // kSignsAsSiteA: advertises keys signed with site-a's certificate over its own connection, and stops at
  // the server's answer.
  // kRefusedMidMaskedInput: streams the first two chunks of its masked input
  // (131,072 of 199,210 elements), then one out of order, which the server
  // refuses — after it added the two — and stops at its Error.
  // kAbortsMidMaskedInput: the same two chunks, then aborts its connection.
  enum class Stop { kAfterShareKeys, kAfterMaskedInput, kSignsAsSiteA, kRefusedMidMaskedInput, kAbortsMidMaskedInput };
  ScriptedSite(const Federation& f, const std::string& name, uint16_t port, Stop stop, fs::path keep)
      : thread_([this, files = f.Files(name), signs = f.Files(stop == Stop::kSignsAsSiteA ? "site-a" : name), port,
                 stop, keep] { status_ = Run(files, signs, port, stop, keep); }) {}
  ~ScriptedSite() { (void)Join(); }  // a test that cares has joined and checked it
  Status Join() {
    if (thread_.joinable()) thread_.join();
    return status_;
  }
  const std::vector<float>& initial_model() const { return model_; }
  const std::string& refusal() const { return refusal_; }  // the server's Error, where it sent one

 private:
  Result<v1::Envelope> Next(RawClient& raw, v1::Envelope::BodyCase wanted) {
    for (;;) {
      ESTUARY_ASSIGN_OR_RETURN(v1::Envelope envelope, raw.Receive());
      if (envelope.body_case() == wanted) return envelope;
      if (envelope.has_heartbeat() || envelope.has_model_chunk()) continue;
      return ProtocolError("scripted site: expected {}, got {}", int(wanted), envelope.ShortDebugString());
    }
  }
  Status Run(const crypto::TlsFiles& files, const crypto::TlsFiles& signs, uint16_t port, Stop stop,
             const fs::path& keep) {
    ESTUARY_ASSIGN_OR_RETURN(auto raw, RawClient::Connect(port, files));
    raw->SetTimeouts(std::chrono::seconds(60));
    ESTUARY_RETURN_IF_ERROR(raw->Handshake());
    ESTUARY_ASSIGN_OR_RETURN(const v1::RoundStart start, raw->AwaitRound(&model_));
    if (!start.has_secagg()) return ProtocolError("scripted site: round {} without a secagg setup", start.round());
    v1::Envelope advertise;
    ESTUARY_ASSIGN_OR_RETURN(const auto identity, client::SecAggIdentity::FromFiles(signs));
    ESTUARY_ASSIGN_OR_RETURN(auto site, client::SecAggSite::Start(start, identity, &advertise));
    ESTUARY_RETURN_IF_ERROR(raw->Send(advertise));
    if (stop == Stop::kSignsAsSiteA) {
      auto refused = Next(*raw, v1::Envelope::kError);
      if (refused.ok()) refusal_ = refused->error().message();
      return refused.status();
    }
    ESTUARY_ASSIGN_OR_RETURN(const v1::Envelope keys, Next(*raw, v1::Envelope::kSecaggKeys));
    ESTUARY_ASSIGN_OR_RETURN(const v1::Envelope shares, site->OnKeys(keys.secagg_keys()));
    ESTUARY_RETURN_IF_ERROR(raw->Send(shares));
    if (stop == Stop::kAfterShareKeys) {
      // Gone once the server has its shares: its mask key must be rebuilt.
      ESTUARY_RETURN_IF_ERROR(Next(*raw, v1::Envelope::kSecaggInbox).status());
      raw->Abort();
      return Status::Ok();
    }
    ESTUARY_ASSIGN_OR_RETURN(const v1::Envelope inbox, Next(*raw, v1::Envelope::kSecaggInbox));
    ESTUARY_RETURN_IF_ERROR(site->OnInbox(inbox.secagg_inbox()));
    std::vector<float> update(model_.size());
    for (size_t i = 0; i < update.size(); ++i) update[i] = 1e-3f * float(int(i % 7) - 3);
    if (stop == Stop::kRefusedMidMaskedInput || stop == Stop::kAbortsMidMaskedInput) {
      ESTUARY_ASSIGN_OR_RETURN(const v1::Envelope open, site->BeginMaskedInput(update, {}));
      ESTUARY_RETURN_IF_ERROR(raw->Send(open));
      for (int i = 0; i < 2; ++i) {
        ESTUARY_ASSIGN_OR_RETURN(const v1::Envelope chunk, site->NextMaskedFrame(65536, 10, 0.5, 0.1));
        ESTUARY_RETURN_IF_ERROR(raw->Send(chunk));
      }
      if (stop == Stop::kAbortsMidMaskedInput) {
        raw->Abort();
        return Status::Ok();
      }
      const uint32_t one = 1;
      ESTUARY_RETURN_IF_ERROR(raw->Send(secagg::MaskedChunkMessage(start.round(), 0, std::span(&one, 1))));
      ESTUARY_ASSIGN_OR_RETURN(const v1::Envelope refused, Next(*raw, v1::Envelope::kError));
      refusal_ = refused.error().message();
      return Status::Ok();
    }
    ESTUARY_ASSIGN_OR_RETURN(auto frames, site->MaskedInput(update, 65536, 10, 0.5, 0.1, keep));
    for (const v1::Envelope& frame : frames) ESTUARY_RETURN_IF_ERROR(raw->Send(frame));
    // Gone with its input in the sum, before signing the survivor set: its
    // neighbours' shares remove its self mask.
    ESTUARY_RETURN_IF_ERROR(Next(*raw, v1::Envelope::kSecaggSurvivors).status());
    raw->Abort();
    return Status::Ok();
  }

  std::vector<float> model_;
  std::string refusal_;
  Status status_;
  std::thread thread_;
};

TEST(SecAggOverTls, ThreeSitesCommitThePlainAggregateOfTheirQuantisedInputsBitForBit) {
  Federation f;
  std::vector<std::string> sites = {"site-a", "site-b", "site-c"};
  for (const auto& s : sites) f.Issue(s);
  const uint16_t port = f.StartServer(2, 3, {"--secagg"});
  std::vector<std::unique_ptr<ChildProcess>> children;
  for (const auto& s : sites) {
    fs::create_directories(f.dir() / ("keep-" + s));
    children.push_back(f.StartClient(s, port, {}, {"--secagg-keep-input", (f.dir() / ("keep-" + s)).string()}));
  }
  ASSERT_TRUE(f.AwaitCommitted(2, std::chrono::seconds(120))) << f.ServerLog();
  for (auto& c : children) EXPECT_EQ(c->Wait(), 0);
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 2u);
  for (const auto& r : *rounds) {
    EXPECT_EQ(r.state, server::RoundState::kCommitted);
    EXPECT_EQ(r.updates_received, 3u);
    ASSERT_TRUE(r.secagg.has_value());
    EXPECT_EQ(r.secagg->stage, "done");
    EXPECT_EQ(r.secagg->sites, 3u);
    EXPECT_EQ(r.secagg->neighbours, 2u);  // the complete graph
    EXPECT_EQ(r.secagg->threshold, 2u);
    EXPECT_EQ(r.secagg->answered, (std::array<uint32_t, 5>{3, 3, 3, 3, 3}));
    EXPECT_EQ(r.secagg->dropouts, (std::array<uint32_t, 5>{0, 0, 0, 0, 0}));
    // The masked inputs: 4 bytes an element, and more than that in framing.
    EXPECT_GT(r.secagg->bytes_up[2], 3u * 199210 * 4);
    EXPECT_LT(r.secagg->bytes_up[2], 3u * 199210 * 4 + 3u * 4096);
    ASSERT_TRUE(r.test_accuracy.has_value());
    EXPECT_GT(*r.test_accuracy, 0.3);  // chance is 0.1
  }
  const double scale = (*rounds)[1].secagg->scale;
  // s = floor((2^31 − 1 − n) / (C · W)), C = 100, W = 3 · 270 (300 less the 10% held out, --eval-split).
  EXPECT_EQ(scale, std::floor((2147483647.0 - 3) / (100.0 * 810)));
  std::vector<Contribution> inputs;
  for (const auto& s : sites) {
    auto kept = KeptInputs(f.dir() / ("keep-" + s), 2);
    ASSERT_EQ(kept.size(), 1u) << s;
    EXPECT_EQ(kept[0].weight, 270u);
    inputs.push_back(std::move(kept[0]));
  }
  const std::vector<float> expected = PlainAggregate(inputs, 100, scale, Checkpoint(*store, 1), 2);
  const std::vector<float> committed = Checkpoint(*store, 2);
  ASSERT_EQ(committed.size(), expected.size());
  EXPECT_EQ(std::memcmp(committed.data(), expected.data(), expected.size() * sizeof(float)), 0)
      << "the committed model is not the plain aggregate of the kept inputs";
  // Not trivially so: the round moved the model.
  EXPECT_NE(committed, Checkpoint(*store, 1));

  const std::string server_bin = BinaryPath("estuary-server").string();
  auto show = RunCommand(fmt::format("{} rounds show 2 --db {}", server_bin, f.db().string()));
  ASSERT_EQ(show.exit_code, 0) << show.output;
  EXPECT_NE(show.output.find("protocol  secagg: 3 sites, k 2, t 2, 32 bits, clip 100"), std::string::npos)
      << show.output;
  EXPECT_NE(show.output.find("reached done"), std::string::npos) << show.output;
  auto json = RunCommand(fmt::format("{} rounds show 2 --db {} --json", server_bin, f.db().string()));
  ASSERT_EQ(json.exit_code, 0) << json.output;
  auto doc = nlohmann::json::parse(json.output, nullptr, false);
  ASSERT_FALSE(doc.is_discarded()) << json.output;
  EXPECT_EQ(doc["protocol"], "secagg");
  EXPECT_EQ(doc["secagg"]["stages"][2]["stage"], "masked input");
  EXPECT_EQ(doc["secagg"]["stages"][2]["bytes_up"], (*rounds)[1].secagg->bytes_up[2]);
  // The consistency check: each site's signature over U3 up (framed, an
  // ECDSA P-256 signature of 70 to 72 bytes); down, what answers it: the
  // unmasking request with the two neighbours' signatures.
  EXPECT_EQ(doc["secagg"]["stages"][3]["stage"], "consistency check");
  EXPECT_EQ(doc["secagg"]["stages"][3]["answered"], 3);
  const server::RoundSecAgg& a = *(*rounds)[1].secagg;
  EXPECT_GT(a.bytes_up[3], 3u * 64);
  EXPECT_LT(a.bytes_up[3], 3u * 100);
  EXPECT_GT(a.bytes_down[3], 3u * 2 * 64);
  EXPECT_NE(show.output.find("consistency check"), std::string::npos) << show.output;
}

TEST(SecAggOverTls, TheRoundCommitsWhenOneSiteDiesAfterSharingKeysAndOneAfterItsMaskedInput) {
  Federation f;
  // Six sites, the complete graph: k = 5, t = 3. With two gone, every
  // secret still has three neighbours left to answer for it.
  std::vector<std::string> sites = {"site-a", "site-b", "site-c", "site-d"};
  for (const auto& s : sites) f.Issue(s);
  f.Issue("gone-after-shares");
  f.Issue("gone-after-input");
  const uint16_t port = f.StartServer(1, 6, {"--secagg"});
  std::vector<std::unique_ptr<ChildProcess>> children;
  for (const auto& s : sites) {
    fs::create_directories(f.dir() / ("keep-" + s));
    children.push_back(f.StartClient(s, port, {}, {"--secagg-keep-input", (f.dir() / ("keep-" + s)).string()}));
  }
  fs::create_directories(f.dir() / "keep-scripted");
  ScriptedSite after_shares(f, "gone-after-shares", port, ScriptedSite::Stop::kAfterShareKeys, f.dir() / "keep-none");
  ScriptedSite after_input(f, "gone-after-input", port, ScriptedSite::Stop::kAfterMaskedInput,
                           f.dir() / "keep-scripted");
  Status shares_done = after_shares.Join(), input_done = after_input.Join();
  EXPECT_TRUE(shares_done.ok()) << shares_done.ToString();
  EXPECT_TRUE(input_done.ok()) << input_done.ToString();
  ASSERT_TRUE(f.AwaitCommitted(1, std::chrono::seconds(120))) << f.ServerLog();
  for (auto& c : children) EXPECT_EQ(c->Wait(), 0);
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();

  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto round = store->GetRound(1);
  ASSERT_TRUE(round.ok() && round->has_value());
  const server::RoundRecord& r = **round;
  ASSERT_EQ(r.state, server::RoundState::kCommitted) << r.detail << "\n" << f.ServerLog();
  ASSERT_TRUE(r.secagg.has_value());
  EXPECT_EQ(r.secagg->sites, 6u);
  EXPECT_EQ(r.secagg->threshold, 3u);  // k = 5 (complete), t = 5/2 + 1
  EXPECT_EQ(r.secagg->answered, (std::array<uint32_t, 5>{6, 6, 5, 4, 4}));
  EXPECT_EQ(r.secagg->dropouts, (std::array<uint32_t, 5>{0, 0, 1, 1, 0}));
  EXPECT_EQ(r.updates_received, 5u);  // the site gone before unmasking is in the sum
  auto participants = ParticipationsByName(*store, 1);
  EXPECT_EQ(participants["gone-after-shares"].status, "dropped");
  EXPECT_EQ(participants["gone-after-input"].status, "committed");
  EXPECT_EQ(participants["gone-after-input"].detail, "in the sum; gone before unmasking");

  std::vector<Contribution> inputs;
  for (const auto& dir : {"keep-site-a", "keep-site-b", "keep-site-c", "keep-site-d", "keep-scripted"}) {
    auto kept = KeptInputs(f.dir() / dir, 1);
    ASSERT_EQ(kept.size(), 1u) << dir;
    inputs.push_back(std::move(kept[0]));
  }
  EXPECT_EQ(inputs[4].weight, 10u);  // the scripted site's Hello
  const std::vector<float> expected =
      PlainAggregate(inputs, 100, r.secagg->scale, after_input.initial_model(), 1);
  const std::vector<float> committed = Checkpoint(*store, 1);
  ASSERT_EQ(committed.size(), expected.size());
  EXPECT_EQ(std::memcmp(committed.data(), expected.data(), expected.size() * sizeof(float)), 0)
      << "the committed model is not the plain aggregate of the five included inputs";
}

// The masked inputs stream into the server's one ring sum, a chunk added as it
// arrives, through one staging slot here (--staging-slots 1: the sites take
// turns, the others paused). One site stops after two of its chunks were
// added (its next one refused), one aborts its connection after two (added or
// not, as the server read them): each is withdrawn from the sum, and the
// committed model is still the plain aggregate of the four complete inputs,
// bit for bit.
TEST(SecAggOverTls, SitesThatStopPartwayThroughTheirMaskedInputAreWithdrawnFromTheSum) {
  Federation f;
  std::vector<std::string> sites = {"site-a", "site-b", "site-c", "site-d"};
  for (const auto& s : sites) f.Issue(s);
  f.Issue("refused-mid-input");
  f.Issue("aborts-mid-input");
  const uint16_t port = f.StartServer(1, 6, {"--secagg", "--staging-slots", "1"});
  std::vector<std::unique_ptr<ChildProcess>> children;
  for (const auto& s : sites) {
    fs::create_directories(f.dir() / ("keep-" + s));
    children.push_back(f.StartClient(s, port, {}, {"--secagg-keep-input", (f.dir() / ("keep-" + s)).string()}));
  }
  ScriptedSite refused(f, "refused-mid-input", port, ScriptedSite::Stop::kRefusedMidMaskedInput, {});
  ScriptedSite aborts(f, "aborts-mid-input", port, ScriptedSite::Stop::kAbortsMidMaskedInput, {});
  Status refused_done = refused.Join(), aborts_done = aborts.Join();
  EXPECT_TRUE(refused_done.ok()) << refused_done.ToString();
  EXPECT_TRUE(aborts_done.ok()) << aborts_done.ToString();
  // Refused only after the server had added its first two chunks.
  EXPECT_NE(refused.refusal().find("a chunk of 1 elements at element 0, expected the next of 199210 at 131072"),
            std::string::npos)
      << refused.refusal();
  ASSERT_TRUE(f.AwaitCommitted(1, std::chrono::seconds(120))) << f.ServerLog();
  for (auto& c : children) EXPECT_EQ(c->Wait(), 0);
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  EXPECT_NE(f.ServerLog().find("refused-mid-input (site "), std::string::npos) << f.ServerLog();
  EXPECT_NE(f.ServerLog().find("stopped partway through its masked input; withdrawn from the sum"), std::string::npos)
      << f.ServerLog();

  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto round = store->GetRound(1);
  ASSERT_TRUE(round.ok() && round->has_value());
  const server::RoundRecord& r = **round;
  ASSERT_EQ(r.state, server::RoundState::kCommitted) << r.detail << "\n" << f.ServerLog();
  ASSERT_TRUE(r.secagg.has_value());
  EXPECT_EQ(r.secagg->answered, (std::array<uint32_t, 5>{6, 6, 4, 4, 4}));
  EXPECT_EQ(r.secagg->dropouts, (std::array<uint32_t, 5>{0, 0, 2, 0, 0}));
  EXPECT_EQ(r.updates_received, 4u);
  std::vector<Contribution> inputs;
  for (const auto& s : sites) {
    auto kept = KeptInputs(f.dir() / ("keep-" + s), 1);
    ASSERT_EQ(kept.size(), 1u) << s;
    inputs.push_back(std::move(kept[0]));
  }
  const std::vector<float> expected = PlainAggregate(inputs, 100, r.secagg->scale, refused.initial_model(), 1);
  const std::vector<float> committed = Checkpoint(*store, 1);
  ASSERT_EQ(committed.size(), expected.size());
  EXPECT_EQ(std::memcmp(committed.data(), expected.data(), expected.size() * sizeof(float)), 0)
      << "the committed model is not the plain aggregate of the four complete inputs";
}

// A site signs the keys it advertises with its own certificate's key; keys
// signed with another site's are refused by the server at once (and by every
// neighbour, client/secagg_site.h), and the round goes on without it.
TEST(SecAggOverTls, KeysSignedWithAnotherSitesCertificateAreRefusedAndTheRoundGoesOn) {
  Federation f;
  std::vector<std::string> sites = {"site-a", "site-b", "site-c"};
  for (const auto& s : sites) f.Issue(s);
  f.Issue("impostor");
  const uint16_t port = f.StartServer(1, 4, {"--secagg"});
  std::vector<std::unique_ptr<ChildProcess>> children;
  for (const auto& s : sites) children.push_back(f.StartClient(s, port));
  ScriptedSite impostor(f, "impostor", port, ScriptedSite::Stop::kSignsAsSiteA, {});
  Status done = impostor.Join();
  EXPECT_TRUE(done.ok()) << done.ToString();
  EXPECT_NE(impostor.refusal().find("secagg: impostor's keys come with the certificate of 'site-a'"),
            std::string::npos)
      << impostor.refusal();
  ASSERT_TRUE(f.AwaitCommitted(1, std::chrono::seconds(120))) << f.ServerLog();
  for (auto& c : children) EXPECT_EQ(c->Wait(), 0);
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto round = store->GetRound(1);
  ASSERT_TRUE(round.ok() && round->has_value());
  EXPECT_EQ((*round)->state, server::RoundState::kCommitted) << (*round)->detail;
  EXPECT_EQ((*round)->updates_received, 3u);
  ASSERT_TRUE((*round)->secagg.has_value());
  EXPECT_EQ((*round)->secagg->dropouts, (std::array<uint32_t, 5>{1, 0, 0, 0, 0}));
}

TEST(SecAggOverTls, TooManyDropoutsAbortTheRoundWithTheStageAndTheCounts) {
  Federation f;
  f.exit_when_done = false;
  f.Issue("site-a");
  f.Issue("site-b");
  f.Issue("gone-1");
  f.Issue("gone-2");
  const uint16_t port = f.StartServer(1, 4, {"--secagg", "--secagg-threshold", "3"});
  auto a = f.StartClient("site-a", port);
  auto b = f.StartClient("site-b", port);
  ScriptedSite gone1(f, "gone-1", port, ScriptedSite::Stop::kAfterShareKeys, {});
  ScriptedSite gone2(f, "gone-2", port, ScriptedSite::Stop::kAfterShareKeys, {});
  EXPECT_TRUE(gone1.Join().ok());
  EXPECT_TRUE(gone2.Join().ok());
  const std::string line =
      "round 1 failed: secagg round 1: masked input: 2 of 4 sites remain, fewer than the threshold 3: refusing to "
      "proceed";
  ASSERT_TRUE(f.AwaitLog(line)) << f.ServerLog();
  f.server().Kill();
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto round = store->GetRound(1);
  ASSERT_TRUE(round.ok() && round->has_value());
  EXPECT_EQ((*round)->state, server::RoundState::kFailed);
  EXPECT_NE((*round)->detail.find("masked input: 2 of 4 sites remain"), std::string::npos) << (*round)->detail;
  ASSERT_TRUE((*round)->secagg.has_value());
  EXPECT_EQ((*round)->secagg->stage, "masked input");
  EXPECT_EQ((*round)->secagg->dropouts, (std::array<uint32_t, 5>{0, 0, 2, 0, 0}));
  EXPECT_EQ((*round)->secagg->answered, (std::array<uint32_t, 5>{4, 4, 2, 0, 0}));
}

// A lora federation of three text sites, one round, served plain and then
// with --secagg: under the merges that need only sums (naive, frozen-a) the
// sites' adapter movements go through the protocol, and the committed model
// is the plain run's within the quantisation's bound, n / (s · W) per element
// (docs/SECAGG.md), plus float rounding of the adapter's values.
struct LoraRun {
  std::vector<float> committed;
  double scale = 0;
  uint64_t weight = 0;    // W: the sites' weights, from their kept inputs
  uint64_t dimension = 0;  // elements each site masked
  double moved = 0;       // the largest movement of one factor element by one site, as it quantised it
};

LoraRun RunLoraFederation(const std::string& merge, bool secagg) {
  Federation f;
  const std::vector<std::string> sites = {"site-a", "site-b", "site-c"};
  for (const auto& s : sites) f.Issue(s);
  // The same words in another order: different data, the same number of
  // examples, so the two runs weigh the sites alike.
  const char* const sayings[] = {"a stitch in time saves nine", "nine saves time in a stitch",
                                 "time in a stitch saves nine"};
  for (size_t i = 0; i < sites.size(); ++i) {
    fs::create_directories(f.dir() / ("text-" + sites[i]));
    std::ofstream out(f.dir() / ("text-" + sites[i]) / "sayings");
    for (int j = 0; j < 120; ++j) out << sayings[i] << ", number " << j << "\n%\n";
  }
  std::vector<std::string> flags = {"--model", "llama-tiny", "--eval-data", (f.dir() / "text-site-a").string(),
                                    "--optimizer", "adamw", "--lr", "0.003", "--batch", "4", "--seq-len", "32",
                                    "--max-local-steps", "3", "--eval-windows", "8", "--update-kind", "lora",
                                    "--lora-rank", "8", "--lora-alpha", "16", "--lora-merge", merge};
  if (secagg) flags.push_back("--secagg");
  const uint16_t port = f.StartServer(1, 3, flags);
  std::vector<std::unique_ptr<ChildProcess>> children;
  for (const auto& s : sites) {
    fs::create_directories(f.dir() / ("keep-" + s));
    children.push_back(f.StartClient(s, port, f.dir() / ("text-" + s),
                                     {"--secagg-keep-input", (f.dir() / ("keep-" + s)).string()}));
  }
  LoraRun run;
  EXPECT_TRUE(f.AwaitCommitted(1, std::chrono::seconds(240))) << f.ServerLog();
  for (auto& c : children) EXPECT_EQ(c->Wait(), 0);
  EXPECT_EQ(f.WaitServer(), 0) << f.ServerLog();
  auto store = f.OpenStore();
  if (!store) return run;
  auto round = store->GetRound(1);
  EXPECT_TRUE(round.ok() && round->has_value());
  if (!round.ok() || !round->has_value()) return run;
  EXPECT_EQ((*round)->state, server::RoundState::kCommitted) << (*round)->detail;
  EXPECT_EQ((*round)->updates_received, 3u);
  EXPECT_EQ((*round)->secagg.has_value(), secagg);
  if (secagg && (*round)->secagg) {
    run.scale = (*round)->secagg->scale;
    EXPECT_EQ((*round)->secagg->answered, (std::array<uint32_t, 5>{3, 3, 3, 3, 3}));
    for (const auto& s : sites) {
      auto kept = KeptInputs(f.dir() / ("keep-" + s), 1);
      EXPECT_EQ(kept.size(), 1u) << s;
      if (kept.empty()) continue;
      run.weight += kept[0].weight;
      run.dimension = kept[0].quantized.size();
      for (uint32_t q : kept[0].quantized) {
        run.moved = std::max(run.moved, std::abs(double(int32_t(q))) / (double(kept[0].weight) * run.scale));
      }
    }
  }
  run.committed = Checkpoint(*store, 1);
  return run;
}

void ExpectSecAggLoraMatchesPlain(const std::string& merge) {
  const LoraRun plain = RunLoraFederation(merge, false);
  const LoraRun secure = RunLoraFederation(merge, true);
  ASSERT_FALSE(plain.committed.empty());
  ASSERT_EQ(secure.committed.size(), plain.committed.size());
  ASSERT_GT(secure.scale, 0);
  ASSERT_GT(secure.weight, 0u);
  // Only the adapter's upload travels: under frozen-a the B factors alone.
  EXPECT_GT(secure.dimension, 0u);
  EXPECT_LT(secure.dimension, plain.committed.size() / 4);
  const double bound = 3.0 / (secure.scale * double(secure.weight));
  double worst = 0;
  size_t differ = 0;
  for (size_t i = 0; i < plain.committed.size(); ++i) {
    const double error = std::abs(double(secure.committed[i]) - double(plain.committed[i]));
    const double slack = bound + 0x1p-22 * (1 + std::abs(double(plain.committed[i])));
    worst = std::max(worst, error / slack);
    differ += secure.committed[i] != plain.committed[i];
  }
  fmt::print("{}: {} elements masked per site, bound {:.3g}, worst error / allowed {:.3f}, {} of {} parameters "
             "differ, largest movement {:.3g}\n",
             merge, secure.dimension, bound, worst, differ, plain.committed.size(), secure.moved);
  EXPECT_LE(worst, 1.0) << merge << ": an element beyond the quantisation bound " << bound;
  EXPECT_GT(differ, 0u) << merge << ": quantisation left no trace: was the protocol bypassed?";
  EXPECT_GT(secure.moved, 100 * bound) << merge << ": the round hardly moved the adapter; the comparison would be empty";
}

TEST(SecAggOverTls, ALoraFederationUnderNaiveMergeCommitsThePlainModelWithinTheQuantisationBound) {
  ExpectSecAggLoraMatchesPlain("naive");
}

TEST(SecAggOverTls, ALoraFederationUnderFrozenAMergeCommitsThePlainModelWithinTheQuantisationBound) {
  ExpectSecAggLoraMatchesPlain("frozen-a");
}

TEST(SecAggOverTls, CombinationsItCannotServeAreRefusedInOneLine) {
  Federation f;
  const std::string server_bin = BinaryPath("estuary-server").string();
  const std::pair<std::string, std::string> cases[] = {
      {"--strategy median", "secagg with strategy median: a robust rule needs the individual updates"},
      {"--dp-noise-multiplier 1 --dp-clip 1", "secagg with dp_noise_multiplier"},
      {"--max-update-norm 5", "secagg with max_update_norm or max_norm_over_median"},
      {"--dp distributed", "config: dp = distributed without dp_noise_multiplier: there is no noise to share"},
      {"--dp distributed --dp-noise-multiplier 1 --dp-adaptive-clip --dp-clipped-count-stddev 5",
       "config: dp = distributed with dp_adaptive_clip"},
      {"--dp distributed --dp-noise-multiplier 1 --dp-survivors 1.5", "config: dp_survivors = 1.5: must be in (0, 1]"},

      {"--secagg-bits 40", "secagg_bits = 40: must be in [2, 32]"},
      {"--model llama-tiny --update-kind lora --lora-merge exact",
       "secagg with update kind lora and lora_merge = exact: the exact merge needs each site's A and B apart"},
  };
  for (const auto& [flags, expected] : cases) {
    std::string args;
    for (const auto& a : f.ServeArgs(1, 2, {"--secagg"})) args += " " + a;
    auto run = RunCommand(fmt::format("{}{} {}", server_bin, args, flags));
    EXPECT_NE(run.exit_code, 0) << flags;
    EXPECT_NE(run.output.find(expected), std::string::npos) << flags << ": " << run.output;
    EXPECT_EQ(std::count(run.output.begin(), run.output.end(), '\n'), 1) << run.output;
  }
  // Without --secagg.
  const std::pair<std::string, std::string> plain[] = {
      {"--dp distributed --dp-noise-multiplier 1", "config: dp = distributed without secagg"},
      {"--dp laplace", "config: dp = 'laplace': expected central or distributed"},
      {"--dp-noise-multiplier 1 --dp-survivors 0.5", "config: dp_survivors = 0.5 without dp = distributed"},
      {"--dp-noise-multiplier 1 --sample-rate 0.5", "config: sample_rate with dp_noise_multiplier needs total_sites"},
      {"--sample-rate 1.5", "config: sample_rate = 1.5: must be in [0, 1]"},
      {"--sample-seed 4", "config: sample_seed without sample_rate"},
      {"--total-sites 4", "config: total_sites = 4 with strategy fedavg: it is for scaffold, or for sample_rate with "
                          "dp_noise_multiplier"},
      {"--secagg --dp distributed --dp-noise-multiplier 1 --sample-rate 0.5",
       "config: sample_rate with dp_noise_multiplier needs total_sites: the mean divides by the expected q · "
       "total_sites, a constant the operator declares, not by who is connected, and the sites' noise shares are "
       "planned for it"},
      {"--secagg --dp distributed --dp-noise-multiplier 1 --total-sites 4",
       "config: total_sites = 4 with strategy fedavg: it is for scaffold, or for sample_rate with"},
      {"--sample-rate 0.5 --clients-per-round 3",
       "serve: --sample-rate and --clients-per-round both choose a round's sites: give one"},
  };
  for (const auto& [flags, expected] : plain) {
    // As `extra`, so that --sample-rate stands in for --clients-per-round.
    std::vector<std::string> extra;
    for (size_t at = 0; at < flags.size();) {
      const size_t end = std::min(flags.find(' ', at), flags.size());
      extra.push_back(flags.substr(at, end - at));
      at = end + 1;
    }
    std::string args;
    for (const auto& a : f.ServeArgs(1, 2, extra)) args += " " + a;
    auto run = RunCommand(server_bin + args);
    EXPECT_NE(run.exit_code, 0) << flags;
    EXPECT_NE(run.output.find(expected), std::string::npos) << flags << ": " << run.output;
    EXPECT_EQ(std::count(run.output.begin(), run.output.end(), '\n'), 1) << run.output;
  }
  // One site a round is no secure aggregation.
  std::string args;
  for (const auto& a : f.ServeArgs(1, 1, {"--secagg"})) args += " " + a;
  auto alone = RunCommand(server_bin + args);
  EXPECT_NE(alone.exit_code, 0);
  EXPECT_NE(alone.output.find("config: secagg with clients_per_round = 1: secure aggregation needs 2 sites a round"),
            std::string::npos)
      << alone.output;
}

// ---- Distributed DP (docs/PRIVACY.md): --secagg --dp distributed.

constexpr uint64_t kMnistMlpElements = 199210;

// The shares' plan for rounds of `sites` sites, as the server must make it.
privacy::DistributedDpPlan PlanFor(double z, uint32_t sites, double survivors = 1) {
  auto plan = privacy::PlanDistributedDpShares(
      {.noise_multiplier = z, .clip = 1, .survivors = survivors, .denominator = double(sites)}, 32, sites,
      kMnistMlpElements);
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  return plan.ok() ? *plan : privacy::DistributedDpPlan{};
}

// Three sites, z = 0.5, C = 1, every site in every round (q = 1). Round 1 in
// one server, round 2 in a restarted one, and a budget between ε after two
// and three rounds stops the federation before round 3. Checked:
// - the committed model is bit for bit the plain aggregate of what the sites
//   masked — their quantised updates with their noise shares in — over the
//   fixed denominator 3: the server unmasked the noised sum;
// - the shares the sites kept sum to noise of variance 3·V (V the plan's)
//   within 6 standard errors, so the noise is there at the calibrated size;
// - the committed model differs from the aggregate of the same inputs
//   without their shares by the shares' sum over 3s, whose RMS is the
//   mean's σ = √(3V)/(3s), at least z·C/3: what the server released never
//   was the un-noised mean;
// - each round's ε in the log is the Gaussian mechanism's at
//   z_eff = √(3V)/Δ (τ = 0 at these variances), and after the restart it
//   continues from the log (the replay recomputes the plan).
TEST(DistributedDpOverTls, SitesNoiseTheirInputsTheServerCommitsTheNoisedSumAndRecordsItsEpsilon) {
  constexpr double kZ = 0.5, kDelta = 1e-5;
  const privacy::DistributedDpPlan plan = PlanFor(kZ, 3);
  ASSERT_GT(plan.site_variance, 0u);
  const double z_eff = std::sqrt(3.0 * double(plan.site_variance)) / plan.sensitivity;
  EXPECT_GE(z_eff, kZ);
  EXPECT_LT(z_eff, kZ * 1.001);
  auto epsilon = [&](int64_t rounds) { return privacy::EpsilonAfterRounds(1.0, z_eff, rounds, kDelta)->epsilon; };
  const std::vector<std::string> dp = {"--secagg", "--dp", "distributed", "--dp-noise-multiplier", "0.5",
                                       "--dp-clip", "1", "--dp-delta", "1e-5", "--dp-max-epsilon",
                                       fmt::format("{}", (epsilon(2) + epsilon(3)) / 2)};
  Federation f;
  const std::vector<std::string> sites = {"site-a", "site-b", "site-c"};
  for (const auto& s : sites) {
    f.Issue(s);
    fs::create_directories(f.dir() / ("keep-" + s));
  }
  for (uint64_t rounds : {1, 3}) {
    const uint16_t port = f.StartServer(rounds, 3, dp);
    std::vector<std::unique_ptr<ChildProcess>> children;
    for (const auto& s : sites) {
      children.push_back(f.StartClient(s, port, {}, {"--secagg-keep-input", (f.dir() / ("keep-" + s)).string()}));
    }
    for (auto& c : children) EXPECT_EQ(c->Wait(), 0);
    ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  }
  EXPECT_NE(f.ServerLog().find("federation stops before round 3: ε would reach"), std::string::npos) << f.ServerLog();
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 2u) << "round 3 never opened";
  for (const auto& r : *rounds) {
    ASSERT_EQ(r.state, server::RoundState::kCommitted) << r.detail;
    ASSERT_TRUE(r.secagg.has_value());
    EXPECT_EQ(r.secagg->scale, plan.scale);
    EXPECT_EQ(r.secagg->clip, 1);
    ASSERT_TRUE(r.privacy.has_value()) << r.round;
    EXPECT_EQ(r.privacy->sampling_rate, 1);
    EXPECT_EQ(r.privacy->noise_multiplier, kZ);
    EXPECT_NEAR(r.privacy->epsilon, epsilon(int64_t(r.round)), 1e-9 * epsilon(int64_t(r.round))) << r.round;
    EXPECT_NEAR(r.privacy->noise_stddev, std::sqrt(3.0 * double(plan.site_variance)) / plan.scale, 1e-9) << r.round;
  }

  std::vector<Contribution> noised, shares;
  for (const auto& s : sites) {
    auto kept = KeptInputs(f.dir() / ("keep-" + s), 2);
    auto share = KeptInputs(f.dir() / ("keep-" + s), 2, ".noise");
    ASSERT_EQ(kept.size(), 1u) << s;
    ASSERT_EQ(share.size(), 1u) << s;
    EXPECT_EQ(kept[0].weight, 1u);  // equal weights under DP
    ASSERT_EQ(kept[0].quantized.size(), kMnistMlpElements);
    ASSERT_EQ(share[0].quantized.size(), kMnistMlpElements);
    noised.push_back(std::move(kept[0]));
    shares.push_back(std::move(share[0]));
  }
  const std::vector<float> previous = Checkpoint(*store, 1);
  const std::vector<float> committed = Checkpoint(*store, 2);
  const std::vector<float> expected = PlainAggregate(noised, 1, plan.scale, previous, 2);
  ASSERT_EQ(committed.size(), expected.size());
  EXPECT_EQ(std::memcmp(committed.data(), expected.data(), expected.size() * sizeof(float)), 0)
      << "the committed model is not the plain aggregate of the noised inputs over 3";

  // The noise the sites added: 3 shares of N_Z(0, V) an element.
  double squares = 0;
  std::vector<Contribution> clean = noised;
  for (size_t i = 0; i < kMnistMlpElements; ++i) {
    int64_t total = 0;
    for (size_t u = 0; u < shares.size(); ++u) {
      total += int32_t(shares[u].quantized[i]);
      clean[u].quantized[i] -= shares[u].quantized[i];
    }
    squares += double(total) * double(total);
  }
  const double variance = squares / double(kMnistMlpElements), target = 3.0 * double(plan.site_variance);
  // The sample variance of d normals has relative standard error √(2/d) = 0.32 %.
  EXPECT_NEAR(variance / target, 1.0, 6 * std::sqrt(2.0 / double(kMnistMlpElements)));

  const std::vector<float> unnoised = PlainAggregate(clean, 1, plan.scale, previous, 2);
  double differences = 0;
  for (size_t i = 0; i < committed.size(); ++i) {
    const double d = double(committed[i]) - double(unnoised[i]);
    differences += d * d;
  }
  const double rms = std::sqrt(differences / double(committed.size()));
  const double sigma = std::sqrt(target) / (3 * plan.scale);
  fmt::print("distributed DP: share variance {}, scale {}, the mean's σ {:.4f} (z·C/3 = {:.4f}); committed − "
             "un-noised: RMS {:.4f}; ε {:.4f} after 2 rounds\n",
             plan.site_variance, plan.scale, sigma, kZ / 3, rms, (*rounds)[1].privacy->epsilon);
  EXPECT_GE(sigma, kZ / 3);
  EXPECT_NEAR(rms / sigma, 1.0, 0.02);

  const std::string server_bin = BinaryPath("estuary-server").string();
  auto json = RunCommand(fmt::format("{} rounds show 2 --db {} --json", server_bin, f.db().string()));
  ASSERT_EQ(json.exit_code, 0) << json.output;
  auto doc = nlohmann::json::parse(json.output, nullptr, false);
  ASSERT_FALSE(doc.is_discarded()) << json.output;
  EXPECT_NEAR(doc["privacy"]["epsilon"].get<double>(), epsilon(2), 1e-9 * epsilon(2)) << json.output;
  auto list = RunCommand(fmt::format("{} rounds list --db {}", server_bin, f.db().string()));
  ASSERT_EQ(list.exit_code, 0) << list.output;
  EXPECT_NE(list.output.find(fmt::format("{:.4g}", (*rounds)[1].privacy->epsilon)), std::string::npos) << list.output;
}

// Four sites sampled, noise calibrated for all four (--dp-survivors 1); one
// leaves after sharing its keys, so three masked inputs arrive: the server
// refuses to unmask a sum holding three quarters of the promised noise.
TEST(DistributedDpOverTls, FewerInputsThanTheNoiseIsCalibratedForAreNotUnmasked) {
  Federation f;
  f.exit_when_done = false;
  for (const auto& s : {"site-a", "site-b", "site-c", "gone"}) f.Issue(s);
  const uint16_t port =
      f.StartServer(1, 4, {"--secagg", "--dp", "distributed", "--dp-noise-multiplier", "1", "--dp-clip", "1"});
  auto a = f.StartClient("site-a", port);
  auto b = f.StartClient("site-b", port);
  auto c = f.StartClient("site-c", port);
  ScriptedSite gone(f, "gone", port, ScriptedSite::Stop::kAfterShareKeys, {});
  EXPECT_TRUE(gone.Join().ok());
  const std::string line = "round 1 failed: secagg round 1: distributed DP: 3 of 4 inputs arrived, fewer than the 4 "
                           "the noise is calibrated for (--dp-survivors 1): refusing to unmask";
  ASSERT_TRUE(f.AwaitLog(line)) << f.ServerLog();
  f.server().Kill();
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto round = store->GetRound(1);
  ASSERT_TRUE(round.ok() && round->has_value());
  EXPECT_EQ((*round)->state, server::RoundState::kFailed);
  EXPECT_FALSE((*round)->privacy.has_value());  // nothing released, nothing spent
  ASSERT_TRUE((*round)->secagg.has_value());
  EXPECT_EQ((*round)->secagg->stage, "masked input");
  EXPECT_EQ((*round)->secagg->answered[2], 3u);
}

// Poisson sampling under distributed DP (--sample-rate 0.75 --total-sites 4,
// seeded for the test): four sites, z = 0.5, two rounds, the second in a
// restarted server. The shares are planned for the run — the expected
// q · total_sites = 3 sites, room in the ring for PoissonPlannedMaximum(4,
// 0.75) = 4 — as estuary-sim plans them, not for the round's draw. Checked:
// - each round takes exactly the seeded draw (3 and then 4 sites) and sums
//   every one of their inputs, at the run's one scale;
// - the committed model is bit for bit the plain aggregate of the noised
//   inputs over q · total_sites = 3, not over the 4 drawn;
// - each round's ε in `rounds show --json` is the accountant's for the
//   Poisson-subsampled distributed discrete Gaussian at q = 0.75 with the
//   shares each round summed, composed over the rounds — across the restart,
//   whose replay plans the same way.
TEST(DistributedDpOverTls, PoissonSampledRoundsArePlannedForTheExpectedPopulationAndChargedAtTheSampleRate) {
  constexpr double kQ = 0.75, kZ = 0.5, kDelta = 1e-5;
  constexpr uint32_t kTotal = 4;
  const std::vector<std::string> names = {"site-a", "site-b", "site-c", "site-d"};
  const uint32_t most = privacy::PoissonPlannedMaximum(kTotal, kQ);
  EXPECT_EQ(most, 4u);
  auto planned = privacy::PlanDistributedDpShares({.noise_multiplier = kZ,
                                                   .clip = 1,
                                                   .survivors = 1,
                                                   .denominator = kQ * kTotal,
                                                   .expected_sites = kQ * kTotal,
                                                   .max_sites = most},
                                                  32, 1, kMnistMlpElements);
  ASSERT_TRUE(planned.ok()) << planned.status().ToString();
  const privacy::DistributedDpPlan plan = *planned;
  EXPECT_EQ(plan.min_included, 3u);
  EXPECT_NE(plan.scale, PlanFor(kZ, 3).scale) << "the ring's room is for 4 sites, not the 3 expected";

  Federation f;
  for (const auto& s : names) {
    f.Issue(s);
    fs::create_directories(f.dir() / ("keep-" + s));
  }
  const std::vector<std::string> flags = {"--secagg", "--dp", "distributed", "--dp-noise-multiplier", "0.5",
                                          "--dp-clip", "1", "--dp-delta", "1e-5", "--sample-rate", "0.75",
                                          "--sample-seed", "3", "--total-sites", "4"};
  for (uint64_t rounds : {1, 2}) {
    const uint16_t port = f.StartServer(rounds, kTotal, flags);
    std::vector<std::unique_ptr<ChildProcess>> children;
    for (const auto& s : names) {
      children.push_back(f.StartClient(s, port, {}, {"--secagg-keep-input", (f.dir() / ("keep-" + s)).string()}));
    }
    for (auto& c : children) EXPECT_EQ(c->Wait(), 0);
    ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  }
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 2u);
  auto accountant = privacy::Accountant::Create(kDelta);
  ASSERT_TRUE(accountant.ok());
  const std::string server_bin = BinaryPath("estuary-server").string();
  std::set<size_t> sizes;
  for (const auto& r : *rounds) {
    ASSERT_EQ(r.state, server::RoundState::kCommitted) << r.detail;
    const std::vector<std::string> drawn = aggregation::PoissonSampleClients(names, kQ, 3, r.round);
    sizes.insert(drawn.size());
    std::vector<std::string> took;
    for (const auto& [name, p] : ParticipationsByName(*store, r.round)) took.push_back(name);
    EXPECT_EQ(took, drawn) << r.round;
    ASSERT_TRUE(r.secagg.has_value());
    EXPECT_EQ(r.secagg->scale, plan.scale) << r.round;

    auto rdp = privacy::DistributedDpRoundRdp(plan, uint32_t(drawn.size()), kQ, accountant->orders());
    ASSERT_TRUE(rdp.ok()) << rdp.status().ToString();
    ASSERT_TRUE(accountant->AddRoundRdp(*rdp).ok());
    const double epsilon = accountant->Spent().epsilon;
    auto json = RunCommand(fmt::format("{} rounds show {} --db {} --json", server_bin, r.round, f.db().string()));
    ASSERT_EQ(json.exit_code, 0) << json.output;
    auto doc = nlohmann::json::parse(json.output, nullptr, false);
    ASSERT_FALSE(doc.is_discarded()) << json.output;
    EXPECT_EQ(doc["clients_selected"].get<size_t>(), drawn.size()) << r.round;
    EXPECT_EQ(doc["updates_received"].get<size_t>(), drawn.size()) << r.round;  // the inputs in the sum
    EXPECT_EQ(doc["privacy"]["sampling_rate"].get<double>(), kQ) << r.round;
    EXPECT_NEAR(doc["privacy"]["epsilon"].get<double>(), epsilon, 1e-9 * epsilon) << r.round;
    EXPECT_NEAR(doc["privacy"]["noise_stddev"].get<double>(),
                std::sqrt(double(drawn.size()) * double(plan.site_variance)) / plan.scale, 1e-9)
        << r.round;
    // Never above the same round unsampled. (At q = 0.75 the general
    // subsampling bound gives this mechanism no gain: the two are equal.)
    auto unsampled = privacy::DistributedDpRoundRdp(plan, uint32_t(drawn.size()), 1, accountant->orders());
    ASSERT_TRUE(unsampled.ok());
    auto alone = privacy::Accountant::Create(kDelta);
    ASSERT_TRUE(alone.ok() && alone->AddRoundRdp(*unsampled).ok());
    if (r.round == 1) EXPECT_LE(epsilon, alone->Spent().epsilon);
  }
  EXPECT_EQ(sizes, (std::set<size_t>{3, 4})) << "the seeded draws of rounds 1 and 2";
  auto list = RunCommand(fmt::format("{} rounds list --db {}", server_bin, f.db().string()));
  ASSERT_EQ(list.exit_code, 0) << list.output;
  fmt::print("$ estuary-server rounds list\n{}", list.output);  // docs/PRIVACY.md shows it

  // Round 2 drew 4 sites; its mean divides by q · total_sites = 3.
  std::vector<Contribution> noised;
  for (const auto& s : aggregation::PoissonSampleClients(names, kQ, 3, 2)) {
    auto kept = KeptInputs(f.dir() / ("keep-" + s), 2);
    ASSERT_EQ(kept.size(), 1u) << s;
    noised.push_back(std::move(kept[0]));
  }
  const std::vector<float> committed = Checkpoint(*store, 2);
  const std::vector<float> expected = PlainAggregate(noised, 1, plan.scale, Checkpoint(*store, 1), 2, kQ * kTotal);
  ASSERT_EQ(committed.size(), expected.size());
  EXPECT_EQ(std::memcmp(committed.data(), expected.data(), expected.size() * sizeof(float)), 0)
      << "the committed model is not the noised inputs' aggregate over q · total_sites = 3";
}

// Poisson sampling under distributed DP refuses, with one line naming the
// round and the counts, a draw the plan cannot hold: more sites than the
// ring has room for (three connected, total_sites 2 at q = 1: room for 2),
// and fewer than the noise is calibrated for (three connected, total_sites 8
// at q = 0.5: the shares are for 4). Nothing is released, nothing spent.
TEST(DistributedDpOverTls, PoissonDrawsThePlanCannotHoldAreRefused) {
  const std::pair<std::vector<std::string>, std::string> cases[] = {
      {{"--sample-rate", "1", "--total-sites", "2"},
       "round 1 failed: secagg round 1: distributed DP: Poisson sampling drew 3 sites, more than the 2 the ring was "
       "planned for (q 1 of total_sites 2): refusing the round"},
      {{"--sample-rate", "0.5", "--sample-seed", "5", "--total-sites", "8"},
       "sites, fewer than the 4 inputs the noise is calibrated for (q 0.5 of total_sites 8, --dp-survivors 1): "
       "refusing the round"},
  };
  for (const auto& [sampling, line] : cases) {
    Federation f;
    f.exit_when_done = false;
    std::vector<std::string> flags = {"--secagg", "--dp", "distributed", "--dp-noise-multiplier", "1", "--dp-clip",
                                      "1"};
    flags.insert(flags.end(), sampling.begin(), sampling.end());
    std::vector<std::unique_ptr<ChildProcess>> children;
    for (const auto& s : {"site-a", "site-b", "site-c"}) f.Issue(s);
    const uint16_t port = f.StartServer(1, 3, flags);
    for (const auto& s : {"site-a", "site-b", "site-c"}) children.push_back(f.StartClient(s, port));
    ASSERT_TRUE(f.AwaitLog(line)) << f.ServerLog();
    f.server().Kill();
    auto store = f.OpenStore();
    ASSERT_TRUE(store);
    auto round = store->GetRound(1);
    ASSERT_TRUE(round.ok() && round->has_value());
    EXPECT_EQ((*round)->state, server::RoundState::kFailed);
    EXPECT_FALSE((*round)->privacy.has_value());
  }
}

}  // namespace
}  // namespace estuary::testing
