// End-to-end: a certified site that sends a poisoned update. The real
// estuary-server and honest estuary-client sites on 127.0.0.1; the attacker
// is a raw client speaking the wire by hand. Each attack runs once with the
// federation's limits off (the model is destroyed, or the round cannot
// commit: what the defences are for) and once with them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "models/checkpoint.h"
#include "server/store.h"
#include "tests/e2e/federation.h"
#include "tests/e2e/harness.h"

namespace estuary::testing {
namespace {

constexpr size_t kChunk = 65536;

// The attacker's upload of `values`, claiming `examples` examples and
// `loss`; returns the server's answer: the UpdateAck, or the Error.
Result<v1::Envelope> Upload(RawClient& c, const v1::RoundStart& start, const std::vector<float>& values,
                            uint64_t examples, double loss = 1.0) {
  v1::Envelope begin = MakeUpdateBegin(start, values, examples);
  begin.mutable_update_begin()->set_train_loss(loss);
  ESTUARY_RETURN_IF_ERROR(c.Send(begin));
  const char* bytes = reinterpret_cast<const char*>(values.data());
  const size_t size = values.size() * sizeof(float);
  for (size_t offset = 0; offset < size; offset += kChunk) {
    // A refused announcement closes the connection: what is still sent goes nowhere.
    if (!c.Send(MakeChunk(start.round(), offset, bytes + offset, std::min(kChunk, size - offset))).ok()) break;
  }
  (void)c.Send(MakeCommit(start.round(), values));
  for (;;) {
    ESTUARY_ASSIGN_OR_RETURN(v1::Envelope reply, c.Receive());
    if (reply.has_update_ack() || reply.has_error()) return reply;
  }
}

struct Outcome {
  std::vector<std::optional<double>> accuracy;  // per committed round
  std::vector<std::string> attacker;            // the attacker's participation per round: "status: detail"
  float largest_weight = 0;                     // of the last committed model, in absolute value
};

// Three honest sites and one attacker over `rounds` rounds with the server's
// `flags`; `attack(round, start, global)` gives what the attacker uploads.
Outcome RunFederation(uint64_t rounds, const std::vector<std::string>& flags,
            const std::function<Result<v1::Envelope>(RawClient&, uint64_t, const v1::RoundStart&,
                                                     const std::vector<float>&)>& attack) {
  Federation f;
  for (const char* name : {"site-a", "site-b", "site-c", "mallory"}) f.Issue(name);
  std::vector<std::string> server = {"--chunk-bytes", std::to_string(kChunk)};
  server.insert(server.end(), flags.begin(), flags.end());
  const uint16_t port = f.StartServer(rounds, 4, server);
  auto mallory = RawClient::Connect(port, f.Files("mallory"));
  EXPECT_TRUE(mallory.ok()) << mallory.status().ToString();
  if (!mallory.ok()) return {};
  EXPECT_TRUE((*mallory)->Handshake().ok());
  std::vector<std::unique_ptr<ChildProcess>> honest;
  for (const char* name : {"site-a", "site-b", "site-c"}) honest.push_back(f.StartClient(name, port));
  for (uint64_t round = 1; round <= rounds; ++round) {
    std::vector<float> global;
    auto start = (*mallory)->AwaitRound(&global);
    if (!start.ok()) break;  // refused and closed: the federation goes on without it
    auto answer = attack(**mallory, round, *start, global);
    if (!answer.ok() || answer->has_error()) break;
  }
  for (auto& site : honest) EXPECT_EQ(site->Wait(), 0);
  EXPECT_EQ(f.WaitServer(), 0) << f.ServerLog();
  Outcome out;
  auto store = f.OpenStore();
  if (!store) return out;
  auto logged = store->Rounds();
  EXPECT_TRUE(logged.ok());
  if (!logged.ok()) return out;
  for (const auto& r : *logged) {
    if (r.state != server::RoundState::kCommitted) continue;
    out.accuracy.push_back(r.test_accuracy);
    auto p = ParticipationsByName(*store, r.round)["mallory"];
    out.attacker.push_back(p.status + ": " + p.detail);
    if (auto path = store->CheckpointFor(r.round); path.ok() && *path) {
      auto model = models::LoadCheckpoint(**path);
      EXPECT_TRUE(model.ok());
      out.largest_weight = 0;
      for (float w : model->data) out.largest_weight = std::max(out.largest_weight, std::abs(w));
    }
  }
  return out;
}

std::vector<float> Filled(const std::vector<float>& like, float value) { return std::vector<float>(like.size(), value); }

// An update of 1e30 in every value (the attack that took a federation from
// 0.946 to 0.098): with no limits it reaches the model; under the default
// relative bound (10 × the last round's median norm) it is scaled down from
// the second round on, and an absolute bound covers the first round too.
TEST(PoisonedUpdate, AHugeUpdateIsScaledDownToTheBound) {
  auto huge_from = [](uint64_t first_poisoned) {
    return [first_poisoned](RawClient& c, uint64_t round, const v1::RoundStart& start,
                            const std::vector<float>& global) {
      // Before the attack, a small update of the honest sites' order.
      return Upload(c, start, Filled(global, round < first_poisoned ? 1e-3f : 1e30f), 300);
    };
  };
  const Outcome undefended = RunFederation(2, {"--max-norm-over-median", "0"}, huge_from(2));
  ASSERT_EQ(undefended.accuracy.size(), 2u);
  EXPECT_GT(undefended.largest_weight, 1e20f) << "without a bound the update reaches the model";

  const Outcome relative = RunFederation(2, {}, huge_from(2));  // the defaults
  ASSERT_EQ(relative.accuracy.size(), 2u);
  EXPECT_EQ(relative.attacker[0], "committed: ");
  EXPECT_NE(relative.attacker[1].find("committed: norm"), std::string::npos) << relative.attacker[1];
  EXPECT_NE(relative.attacker[1].find("scaled down to the bound"), std::string::npos) << relative.attacker[1];
  EXPECT_LT(relative.largest_weight, 100.0f);
  ASSERT_TRUE(relative.accuracy[1].has_value());
  EXPECT_GT(*relative.accuracy[1], 0.3);  // chance is 0.1

  const Outcome absolute = RunFederation(1, {"--max-update-norm", "10"}, huge_from(1));
  ASSERT_EQ(absolute.accuracy.size(), 1u);
  EXPECT_NE(absolute.attacker[0].find("scaled down to the bound 10"), std::string::npos) << absolute.attacker[0];
  EXPECT_LT(absolute.largest_weight, 100.0f);
}

// Under FedAdam an update beyond √FLT_MAX used to fail the whole round when
// it finished ("overflows float"), discarding the honest updates with it;
// now that one update is refused at its fold, with the reason, and the
// round commits with the others.
TEST(PoisonedUpdate, AnUpdateFedAdamCannotFoldIsRefusedAndTheRoundCommits) {
  const Outcome out = RunFederation(1, {"--strategy", "fedadam", "--max-norm-over-median", "0"},
                          [](RawClient& c, uint64_t, const v1::RoundStart& start, const std::vector<float>& global) {
                            auto ack = Upload(c, start, Filled(global, 1e20f), 300);
                            EXPECT_TRUE(ack.ok() && ack->has_update_ack() && !ack->update_ack().accepted());
                            if (ack.ok() && ack->has_update_ack()) {
                              EXPECT_NE(ack->update_ack().detail().find("overflows the second moment"),
                                        std::string::npos)
                                  << ack->update_ack().detail();
                            }
                            return ack;
                          });
  ASSERT_EQ(out.accuracy.size(), 1u) << "the round committed with the honest updates";
  EXPECT_NE(out.attacker[0].find("rejected: "), std::string::npos) << out.attacker[0];
  EXPECT_LT(out.largest_weight, 100.0f);
}

// The weight a site claims and the loss it reports are checked before a byte
// is staged: 2^40 examples beyond the federation's cap, or a loss of -1e300,
// get one line back and the round commits with the honest sites.
TEST(PoisonedUpdate, AnImplausibleClaimIsRefusedBeforeStaging) {
  for (const auto& [examples, loss, expected] :
       {std::tuple<uint64_t, double, std::string>{uint64_t{1} << 40, 1.0, "beyond the federation's max_examples of 100000"},
        {300, -1e300, "train_loss -1e+300 is not a loss"}}) {
    const Outcome out =
        RunFederation(1, {"--max-examples", "100000"},
            [&](RawClient& c, uint64_t, const v1::RoundStart& start, const std::vector<float>& global) {
              auto reply = Upload(c, start, Filled(global, 0.5f), examples, loss);
              EXPECT_TRUE(reply.ok() && reply->has_error()) << expected;
              if (reply.ok() && reply->has_error()) {
                EXPECT_EQ(reply->error().code(), v1::Error::BAD_MESSAGE);
                EXPECT_NE(reply->error().message().find(expected), std::string::npos) << reply->error().message();
              }
              return reply;
            });
    ASSERT_EQ(out.accuracy.size(), 1u) << expected;
    EXPECT_NE(out.attacker[0].find("rejected: "), std::string::npos) << out.attacker[0];
    EXPECT_LT(out.largest_weight, 100.0f);
  }
}

}  // namespace
}  // namespace estuary::testing
