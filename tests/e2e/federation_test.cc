// End-to-end: the real estuary-server and estuary-client binaries as child
// processes, real mutual TLS on 127.0.0.1, real SQLite. Each test ends by
// itself: the server is told to exit after its last round, and every raw
// socket read gives up after 30 s.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <csignal>
#include <fstream>
#include <thread>

#include "crypto/certs.h"
#include "crypto/revocation.h"
#include "models/checkpoint.h"
#include "models/federated_model.h"
#include "models/language_model.h"
#include "models/llama.h"
#include "models/lora.h"
#include "models/lora_federation.h"
#include "proto/frame.h"
#include "privacy/accountant.h"
#include "proto/wire.h"
#include "server/store.h"
#include "simulations/server_process.h"
#include "tests/e2e/federation.h"
#include "tests/e2e/harness.h"

namespace estuary::testing {
namespace {

TEST(Federation, TwoSitesTrainTwoRoundsAndTheOperatorReadsTheLog) {
  Federation f;
  f.Issue("site-a");
  f.Issue("site-b");
  const uint16_t port = f.StartServer(2, 2);
  auto a = f.StartClient("site-a", port);
  auto b = f.StartClient("site-b", port);
  EXPECT_EQ(a->Wait(), 0);
  EXPECT_EQ(b->Wait(), 0);
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  // The operator sees how many sites the first round still waits for.
  const std::string log = f.ServerLog();
  EXPECT_NE(log.find("waiting for 2 clients to connect"), std::string::npos) << log;
  EXPECT_NE(log.find("(1 connected; waiting for 1 more before round 1 opens)"), std::string::npos) << log;
  EXPECT_NE(log.find("(2 connected)"), std::string::npos) << log;

  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 2u);
  std::string previous_checksum;
  for (const auto& r : *rounds) {
    EXPECT_EQ(r.state, server::RoundState::kCommitted);
    EXPECT_EQ(r.clients_selected, 2u);
    EXPECT_EQ(r.updates_received, 2u);
    ASSERT_TRUE(r.test_accuracy.has_value());
    EXPECT_GT(*r.test_accuracy, 0.3);  // a learnable problem: chance is 0.1
    EXPECT_EQ(r.global_checksum.size(), 64u);
    EXPECT_NE(r.global_checksum, previous_checksum);
    previous_checksum = r.global_checksum;
    EXPECT_GT(r.bytes_up, 0u);
    EXPECT_GT(r.bytes_down, 0u);
  }
  auto participants = ParticipationsByName(*store, 1);
  ASSERT_EQ(participants.size(), 2u);
  EXPECT_EQ(participants["site-a"].status, "committed");
  EXPECT_EQ(participants["site-a"].examples, 270u);  // 300, less the 10% held out (--eval-split)
  EXPECT_EQ(participants["site-b"].status, "committed");
  // Every round each site downloads the new global model once: 199,210 f32.
  EXPECT_EQ((*rounds)[1].bytes_down, 2u * 199210 * 4);

  // The checkpoint on disk is the model the log describes.
  auto path = store->CheckpointFor(2);
  ASSERT_TRUE(path.ok() && path->has_value());
  auto checkpoint = models::LoadCheckpoint(**path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();

  // The operator CLI.
  const std::string server_bin = BinaryPath("estuary-server").string();
  auto list = RunCommand(fmt::format("{} rounds list --db {} --json", server_bin, f.db().string()));
  ASSERT_EQ(list.exit_code, 0) << list.output;
  auto json = nlohmann::json::parse(list.output, nullptr, false);
  ASSERT_FALSE(json.is_discarded()) << list.output;
  auto show = RunCommand(fmt::format("{} rounds show 1 --db {}", server_bin, f.db().string()));
  ASSERT_EQ(show.exit_code, 0) << show.output;
  EXPECT_NE(show.output.find("site-a"), std::string::npos) << show.output;
  EXPECT_NE(show.output.find((*rounds)[0].global_checksum), std::string::npos) << show.output;
  // The operator sees what one update cost.
  EXPECT_NE(show.output.find(fmt::format("update kind full (fedavg): {} bytes per update",
                                         (*rounds)[0].bytes_up / (*rounds)[0].updates_received)),
            std::string::npos)
      << show.output;
  auto clients = RunCommand(fmt::format("{} clients --db {}", server_bin, f.db().string()));
  ASSERT_EQ(clients.exit_code, 0) << clients.output;
  EXPECT_NE(clients.output.find("site-b"), std::string::npos);
  auto missing = RunCommand(fmt::format("{} rounds show 9 --db {}", server_bin, f.db().string()));
  EXPECT_NE(missing.exit_code, 0);
  // Export is for decoders; a round that is not there is named.
  for (const auto& [flags, expected] :
       {std::pair<std::string, std::string>{"", "model 'mlp' is not a decoder; its checkpoint " + **path},
        {"--round 9", "round 9 is not in the log"}}) {
    auto exported = RunCommand(fmt::format("{} export --db {} --out {} {}", server_bin, f.db().string(),
                                           (f.dir() / "export").string(), flags));
    EXPECT_NE(exported.exit_code, 0) << flags;
    EXPECT_NE(exported.output.find(expected), std::string::npos) << exported.output;
    EXPECT_EQ(std::count(exported.output.begin(), exported.output.end(), '\n'), 1) << exported.output;
  }
}

// A site whose data is text trains the language model the server names; the
// server scores it on the held-out documents of the same corpus.
TEST(Federation, ATextSiteTrainsTheLanguageModel) {
  Federation f;
  f.Issue("library");
  const fs::path text = f.dir() / "text";
  fs::create_directories(text);
  {
    std::ofstream out(text / "proverbs");
    for (int i = 0; i < 200; ++i) out << "a stitch in time saves nine, number " << i << "\n%\n";
  }
  const uint16_t port =
      f.StartServer(2, 1, {"--model", "llama-tiny", "--eval-data", text.string(), "--optimizer", "adamw", "--lr",
                           "0.003", "--batch", "4", "--seq-len", "32", "--max-local-steps", "3", "--eval-windows", "8"});
  ASSERT_NE(port, 0) << f.ServerLog();
  auto site = f.StartClient("library", port, text);
  EXPECT_EQ(site->Wait(), 0);
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 2u);
  for (const auto& r : *rounds) {
    EXPECT_EQ(r.state, server::RoundState::kCommitted);
    EXPECT_EQ(r.updates_received, 1u);
    ASSERT_TRUE(r.test_loss.has_value());
    EXPECT_LT(*r.test_loss, 5.5);  // below an untrained byte model's ln(256)
  }
  EXPECT_LT(*(*rounds)[1].test_loss, *(*rounds)[0].test_loss);
  auto participants = ParticipationsByName(*store, 1);
  EXPECT_GT(participants["library"].examples, 5000u);  // tokens, the FedAvg weight of a text site

  // Exported, round 1's model is a Hugging Face directory holding the checkpoint's weights.
  auto exported = RunCommand(fmt::format("{} export --db {} --round 1 --out {}", BinaryPath("estuary-server").string(),
                                         f.db().string(), (f.dir() / "export").string()));
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  EXPECT_NE(exported.output.find("round 1 of a full llama-tiny federation"), std::string::npos) << exported.output;
  auto path = store->CheckpointFor(1);
  ASSERT_TRUE(path.ok() && path->has_value());
  auto checkpoint = models::LoadCheckpoint(**path);
  auto model = models::LoadHfCheckpoint(f.dir() / "export" / "model");
  ASSERT_TRUE(checkpoint.ok() && model.ok()) << model.status().ToString();
  ASSERT_EQ(model->parameters().size(), checkpoint->data.size());
  EXPECT_TRUE(std::equal(checkpoint->data.begin(), checkpoint->data.end(), model->parameters().begin()));
  // A checkpoint changed on disk is not exported as the round's model.
  auto second = store->CheckpointFor(2);
  ASSERT_TRUE(second.ok() && second->has_value());
  {
    std::fstream file(**second, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(-1, std::ios::end);
    file.put('\x7f');
  }
  exported = RunCommand(fmt::format("{} export --db {} --out {}", BinaryPath("estuary-server").string(),
                                    f.db().string(), (f.dir() / "export2").string()));
  EXPECT_NE(exported.exit_code, 0);
  EXPECT_NE(exported.output.find("differs from round 2's"), std::string::npos) << exported.output;
  EXPECT_FALSE(fs::exists(f.dir() / "export2")) << "nothing is written";
}

TEST(Federation, RefusedHandshakesAreLoggedWithThePeerAddress) {
  Federation f;
  f.Issue("site-good");
  crypto::CertOptions expired;
  expired.not_before = -std::chrono::hours(48);
  expired.not_after = -std::chrono::hours(24);
  f.Issue("site-expired", expired);
  // A CA the federation never trusted.
  TempDir foreign;
  ASSERT_TRUE(crypto::InitCa(foreign.path()).ok());
  ASSERT_TRUE(crypto::IssueCertificate(foreign.path(), "site-foreign").ok());

  const uint16_t port = f.StartServer(1, 1);
  // SIGHUP without a revocation list: said, and nothing else happens.
  ASSERT_EQ(::kill(f.server().pid(), SIGHUP), 0);
  EXPECT_TRUE(f.AwaitLog("SIGHUP: no revocation list (--crl) to reload")) << f.ServerLog();
  const auto no_cert = crypto::TlsFiles{{}, {}, f.certs() / "ca.pem"};
  const auto foreign_files = crypto::TlsFiles{foreign / "site-foreign.pem", foreign / "site-foreign.key", f.certs() / "ca.pem"};
  for (const auto& files : {no_cert, foreign_files, f.Files("site-expired")}) {
    auto client = RawClient::Connect(port, files);
    if (client.ok()) {
      // TLS 1.3: the refusal arrives as an alert on the first read.
      EXPECT_FALSE((*client)->Handshake().ok()) << files.cert;
    }
  }
  // The server still serves a good site to the end.
  auto good = f.StartClient("site-good", port);
  EXPECT_EQ(good->Wait(), 0);
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();

  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto events = store->Events();
  ASSERT_TRUE(events.ok());
  int refused = 0;
  for (const auto& e : *events) {
    if (e.kind != "handshake_refused") continue;
    ++refused;
    EXPECT_EQ(e.peer.rfind("127.0.0.1:", 0), 0u) << e.peer;
    EXPECT_FALSE(e.detail.empty());
  }
  EXPECT_EQ(refused, 3);
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 1u);
  EXPECT_EQ((*rounds)[0].state, server::RoundState::kCommitted);

  // The operator reads them with the CLI: all three, or the last one.
  const std::string server_bin = BinaryPath("estuary-server").string();
  auto listed = RunCommand(fmt::format("{} events --db {} --json", server_bin, f.db().string()));
  ASSERT_EQ(listed.exit_code, 0) << listed.output;
  const auto json = nlohmann::json::parse(listed.output);
  ASSERT_EQ(json.size(), 3u) << listed.output;
  for (const auto& e : json) {
    EXPECT_EQ(e["kind"], "handshake_refused");
    EXPECT_EQ(e["peer"].get<std::string>().rfind("127.0.0.1:", 0), 0u);
  }
  EXPECT_NE(json[2]["detail"].get<std::string>().find("certificate has expired"), std::string::npos) << listed.output;
  auto last = RunCommand(fmt::format("{} events --db {} --limit 1", server_bin, f.db().string()));
  ASSERT_EQ(last.exit_code, 0) << last.output;
  EXPECT_EQ(std::count(last.output.begin(), last.output.end(), '\n'), 2) << last.output;  // header + one
  EXPECT_NE(last.output.find("certificate has expired"), std::string::npos) << last.output;
}

// Revocation, as an operator does it: a site revoked before the server
// starts is refused at the handshake and its client stops, saying why; a
// connected site revoked while the federation waits for its third site is
// closed on SIGHUP and stops too; the site, issued a new certificate under
// its name, rejoins, and the federation completes with it.
TEST(Federation, ARevokedSiteIsRefusedClosedOnSighupAndRejoinsWithANewCertificate) {
  Federation f;
  for (const char* name : {"site-a", "site-b", "site-c", "site-d"}) f.Issue(name);
  // A list valid for three more days: the server warns that it needs renewing.
  ASSERT_TRUE(crypto::RevokeCertificate(f.certs(), "site-c", crypto::RevocationReason::kUnspecified,
                                        {.valid_for = std::chrono::hours(72)})
                  .ok());
  const auto crl = (f.certs() / "crl.pem").string();
  // Three sites a round: nothing starts before site-b is revoked and back.
  const uint16_t port = f.StartServer(2, 3, {"--crl", crl});
  ASSERT_NE(port, 0);
  EXPECT_TRUE(f.AwaitLog("1 revoked certificate(s)")) << f.ServerLog();
  EXPECT_TRUE(f.AwaitLog("is less than 7 days away; renew it")) << f.ServerLog();

  auto c = f.StartClient("site-c", port);
  EXPECT_NE(c->Wait(), 0);
  EXPECT_NE(f.ClientLog("site-c").find("the federation revoked this site's certificate"), std::string::npos)
      << f.ClientLog("site-c");

  // A connection with site-b's certificate whose TLS handshake passes now,
  // and whose Hello comes only after the list that revokes it is loaded.
  auto early = RawClient::Connect(port, f.Files("site-b"));
  ASSERT_TRUE(early.ok()) << early.status().ToString();
  auto a = f.StartClient("site-a", port);
  auto b = f.StartClient("site-b", port);
  ASSERT_TRUE(f.AwaitLog("client site-a connected") && f.AwaitLog("client site-b connected")) << f.ServerLog();
  auto b_serial = crypto::CertificateSerial(f.Files("site-b").cert);
  ASSERT_TRUE(b_serial.ok());
  auto revoked = crypto::RevokeCertificate(f.certs(), "site-b", crypto::RevocationReason::kKeyCompromise);
  ASSERT_TRUE(revoked.ok() && *revoked) << revoked.status().ToString();
  ASSERT_EQ(::kill(f.server().pid(), SIGHUP), 0);
  EXPECT_NE(b->Wait(), 0) << "a revoked site stops instead of reconnecting";
  v1::Envelope hello;
  hello.mutable_hello()->set_protocol_version(proto::kProtocolVersion);
  ASSERT_TRUE((*early)->Send(hello).ok());
  auto refused_hello = (*early)->Receive();
  ASSERT_TRUE(refused_hello.ok()) << refused_hello.status().ToString();
  ASSERT_TRUE(refused_hello->has_error()) << proto::BodyName(*refused_hello);
  EXPECT_EQ(refused_hello->error().code(), v1::Error::CERTIFICATE_REVOKED);
  EXPECT_TRUE((*early)->Closed());
  EXPECT_NE(f.ClientLog("site-b").find("the federation revoked this site's certificate"), std::string::npos)
      << f.ClientLog("site-b");

  // Issued again under the same name (a new key, a new serial): it rejoins.
  std::filesystem::remove(f.Files("site-b").cert);
  std::filesystem::remove(f.Files("site-b").key);
  f.Issue("site-b");
  auto rejoined = f.StartClient("site-b", port);
  auto d = f.StartClient("site-d", port);
  EXPECT_EQ(rejoined->Wait(), 0) << f.ClientLog("site-b");
  EXPECT_EQ(a->Wait(), 0) << f.ClientLog("site-a");
  EXPECT_EQ(d->Wait(), 0) << f.ClientLog("site-d");
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();

  const std::string log = f.ServerLog();
  EXPECT_NE(log.find("SIGHUP: reloaded"), std::string::npos) << log;
  EXPECT_NE(log.find(fmt::format("certificate serial {} is revoked; closing its connection", *b_serial)),
            std::string::npos)
      << log;
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto events = store->Events();
  ASSERT_TRUE(events.ok());
  int closed = 0, refused = 0;
  for (const auto& e : *events) {
    if (e.kind == "certificate_revoked") {
      ++closed;
      EXPECT_EQ(e.peer.rfind("site-b@127.0.0.1:", 0), 0u) << e.peer;
      EXPECT_EQ(e.detail, "serial " + *b_serial);
    }
    if (e.kind == "handshake_refused" && e.detail.find("certificate revoked") != std::string::npos) ++refused;
  }
  EXPECT_EQ(closed, 2) << "site-b's connection, and the early one's hello";
  EXPECT_EQ(refused, 1) << "site-c's handshake";
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 2u);
  for (uint64_t r = 1; r <= 2; ++r) {
    EXPECT_EQ((*rounds)[r - 1].state, server::RoundState::kCommitted);
    EXPECT_EQ(ParticipationsByName(*store, r).count("site-b"), 1u) << "the re-issued site-b, round " << r;
  }
  // The operator's list of certificates: site-c revoked, the re-issued site-b valid.
  auto listed = RunCommand(fmt::format("{} certs list --dir {} --json", BinaryPath("estuary-server").string(),
                                       f.certs().string()));
  ASSERT_EQ(listed.exit_code, 0) << listed.output;
  const auto certs = nlohmann::json::parse(listed.output);
  std::map<std::string, std::string> state;
  for (const auto& c : certs) state[c["name"].get<std::string>()] = c["state"].get<std::string>();
  EXPECT_EQ(state["site-c"], "revoked");
  EXPECT_EQ(state["site-b"], "valid");
  EXPECT_EQ(state["site-a"], "valid");
  EXPECT_EQ(state["server"], "valid");
}

TEST(Federation, BadFramesGetAnErrorAndAClosedConnection) {
  Federation f;
  f.Issue("site-good");
  f.Issue("site-bad");
  const uint16_t port = f.StartServer(1, 1, {"--max-frame", "65536", "--chunk-bytes", "32768"});
  {
    auto client = RawClient::Connect(port, f.Files("site-bad"));
    ASSERT_TRUE(client.ok());
    ASSERT_TRUE((*client)->SendBytes(std::string("\x00\x00\x00\x08garbage!", 12)).ok());
    auto reply = (*client)->Receive();
    ASSERT_TRUE(reply.ok()) << reply.status().ToString();
    ASSERT_TRUE(reply->has_error());
    EXPECT_EQ(reply->error().code(), v1::Error::BAD_FRAME);
    EXPECT_TRUE((*client)->Closed());
  }
  {
    auto client = RawClient::Connect(port, f.Files("site-bad"));
    ASSERT_TRUE(client.ok());
    ASSERT_TRUE((*client)->SendBytes(std::string("\x7f\xff\xff\xff", 4)).ok());
    auto reply = (*client)->Receive();
    ASSERT_TRUE(reply.ok());
    ASSERT_TRUE(reply->has_error());
    EXPECT_NE(reply->error().message().find("exceeds the limit of 65536"), std::string::npos) << reply->error().message();
    EXPECT_TRUE((*client)->Closed());
  }
  {
    auto client = RawClient::Connect(port, f.Files("site-bad"));
    ASSERT_TRUE(client.ok());
    v1::Envelope update;
    update.mutable_update_commit()->set_round(1);
    ASSERT_TRUE((*client)->Send(update).ok());
    auto reply = (*client)->Receive();
    ASSERT_TRUE(reply.ok());
    ASSERT_TRUE(reply->has_error());
    EXPECT_NE(reply->error().message().find("expected hello first"), std::string::npos);
    EXPECT_TRUE((*client)->Closed());
  }
  auto good = f.StartClient("site-good", port);
  EXPECT_EQ(good->Wait(), 0);
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  auto store = f.OpenStore();
  auto rounds = store->Rounds();
  ASSERT_EQ(rounds->size(), 1u);
  EXPECT_EQ((*rounds)[0].state, server::RoundState::kCommitted);
  EXPECT_EQ((*rounds)[0].updates_received, 1u);
}

// Seven selected sites: a real client, and six raw ones that each break the
// upload protocol differently. The round commits with exactly the two valid
// updates; nothing of the others reaches the aggregate.
TEST(Federation, UploadViolationsAreRejectedAndTheRoundCarriesOn) {
  Federation f;
  const std::vector<std::string> raw = {"site-dup",         "site-offset", "site-dtype",
                                       "site-wrong-round", "site-sum",    "site-killed"};
  for (const auto& name : raw) f.Issue(name);
  f.Issue("site-good");
  const uint16_t port = f.StartServer(1, 7, {"--chunk-bytes", "65536"});
  std::map<std::string, std::unique_ptr<RawClient>> clients;
  for (const auto& name : raw) {
    auto client = RawClient::Connect(port, f.Files(name));
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    ASSERT_TRUE((*client)->Handshake().ok());
    clients[name] = std::move(client).value();
  }
  auto good = f.StartClient("site-good", port);
  std::map<std::string, v1::RoundStart> starts;
  std::vector<float> global;
  for (const auto& name : raw) {
    auto start = clients[name]->AwaitRound(&global);
    ASSERT_TRUE(start.ok()) << name << ": " << start.status().ToString();
    starts[name] = *start;
  }
  const size_t n = global.size();
  const std::vector<float> zeros(n, 0.0f);

  // A complete valid update (a zero delta), then a second one in the same round.
  {
    auto& c = *clients["site-dup"];
    const auto& start = starts["site-dup"];
    ASSERT_TRUE(c.Send(MakeUpdateBegin(start, zeros, 50)).ok());
    for (size_t offset = 0; offset < n * 4; offset += 65536) {
      ASSERT_TRUE(c.Send(MakeChunk(start.round(), offset, reinterpret_cast<const char*>(zeros.data()) + offset,
                                   std::min<size_t>(65536, n * 4 - offset))).ok());
    }
    ASSERT_TRUE(c.Send(MakeCommit(start.round(), zeros)).ok());
    auto ack = c.Receive();
    ASSERT_TRUE(ack.ok() && ack->has_update_ack()) << ack.status().ToString();
    EXPECT_TRUE(ack->update_ack().accepted());
    ASSERT_TRUE(c.Send(MakeUpdateBegin(start, zeros, 50)).ok());
    auto reply = c.Receive();
    ASSERT_TRUE(reply.ok() && reply->has_error());
    EXPECT_EQ(reply->error().code(), v1::Error::DUPLICATE_UPDATE) << reply->error().message();
    EXPECT_TRUE(c.Closed());
  }
  // A chunk that skips ahead of the next expected byte.
  {
    auto& c = *clients["site-offset"];
    ASSERT_TRUE(c.Send(MakeUpdateBegin(starts["site-offset"], zeros, 50)).ok());
    ASSERT_TRUE(c.Send(MakeChunk(1, 4096, zeros.data(), 4096)).ok());
    auto reply = c.Receive();
    ASSERT_TRUE(reply.ok() && reply->has_error());
    EXPECT_EQ(reply->error().code(), v1::Error::BAD_CHUNK);
    EXPECT_NE(reply->error().message().find("offset 4096"), std::string::npos) << reply->error().message();
    EXPECT_TRUE(c.Closed());
  }
  // A chunk whose dtype disagrees with the manifest.
  {
    auto& c = *clients["site-dtype"];
    ASSERT_TRUE(c.Send(MakeUpdateBegin(starts["site-dtype"], zeros, 50)).ok());
    ASSERT_TRUE(c.Send(MakeChunk(1, 0, zeros.data(), 4096, v1::DTYPE_BF16)).ok());
    auto reply = c.Receive();
    ASSERT_TRUE(reply.ok() && reply->has_error());
    EXPECT_EQ(reply->error().code(), v1::Error::BAD_CHUNK);
    EXPECT_NE(reply->error().message().find("DTYPE_BF16"), std::string::npos) << reply->error().message();
    EXPECT_TRUE(c.Closed());
  }
  // An update for a round that is not open.
  {
    auto& c = *clients["site-wrong-round"];
    auto start = starts["site-wrong-round"];
    start.set_round(7);
    ASSERT_TRUE(c.Send(MakeUpdateBegin(start, zeros, 50)).ok());
    auto reply = c.Receive();
    ASSERT_TRUE(reply.ok() && reply->has_error());
    EXPECT_EQ(reply->error().code(), v1::Error::ROUND_NOT_OPEN);
    EXPECT_TRUE(c.Closed());
  }
  // Every byte sent, but the commit announces another checksum.
  {
    auto& c = *clients["site-sum"];
    const auto& start = starts["site-sum"];
    ASSERT_TRUE(c.Send(MakeUpdateBegin(start, zeros, 50)).ok());
    for (size_t offset = 0; offset < n * 4; offset += 65536) {
      ASSERT_TRUE(c.Send(MakeChunk(start.round(), offset, reinterpret_cast<const char*>(zeros.data()) + offset,
                                   std::min<size_t>(65536, n * 4 - offset))).ok());
    }
    std::vector<float> other = zeros;
    other[0] = 1.0f;
    ASSERT_TRUE(c.Send(MakeCommit(start.round(), other)).ok());
    auto reply = c.Receive();
    ASSERT_TRUE(reply.ok() && reply->has_error());
    EXPECT_EQ(reply->error().code(), v1::Error::CHECKSUM_MISMATCH) << reply->error().message();
    EXPECT_TRUE(c.Closed());
  }
  // Killed mid-upload: half of a poisonous update, then the socket dies.
  {
    auto& c = *clients["site-killed"];
    const std::vector<float> poison(n, 1e6f);
    ASSERT_TRUE(c.Send(MakeUpdateBegin(starts["site-killed"], poison, 1000000)).ok());
    ASSERT_TRUE(c.Send(MakeChunk(1, 0, poison.data(), 65536)).ok());
    c.Abort();
  }
  EXPECT_EQ(good->Wait(), 0);
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();

  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto round = store->GetRound(1);
  ASSERT_TRUE(round.ok() && round->has_value());
  EXPECT_EQ((*round)->state, server::RoundState::kCommitted);
  EXPECT_EQ((*round)->clients_selected, 7u);
  EXPECT_EQ((*round)->updates_received, 2u);
  auto p = ParticipationsByName(*store, 1);
  EXPECT_EQ(p["site-good"].status, "committed");
  EXPECT_EQ(p["site-dup"].status, "committed");
  EXPECT_EQ(p["site-offset"].status, "rejected");
  EXPECT_EQ(p["site-dtype"].status, "rejected");
  EXPECT_EQ(p["site-wrong-round"].status, "rejected");
  EXPECT_EQ(p["site-sum"].status, "rejected");
  EXPECT_EQ(p["site-killed"].status, "dropped") << f.ServerLog();

  // FedAvg of the good update (270 examples) and a zero delta (50 examples):
  // the model moved, but by far less than the poisoned half-upload would have.
  auto path = store->CheckpointFor(1);
  ASSERT_TRUE(path.ok() && path->has_value());
  auto checkpoint = models::LoadCheckpoint(**path);
  ASSERT_TRUE(checkpoint.ok());
  float max_change = 0;
  for (size_t i = 0; i < n; ++i) max_change = std::max(max_change, std::abs(checkpoint->data[i] - global[i]));
  EXPECT_GT(max_change, 0.0f);
  EXPECT_LT(max_change, 10.0f);
}

// A rank-r adapter on q, k, v, o with alpha 16, as the tests' federations train.
models::LoraConfig LoraOf(int rank) {
  models::LoraConfig lora;
  lora.rank = rank;
  lora.alpha = 16;
  return lora;
}

// `estuary-server export` of a lora federation's last round, read back: the
// base and the adapter are the checkpoint's values bit for bit, the adapter
// config is the federation's, and the adapter on that base gives the merged
// model's logits. Under naive and frozen-a the base is the pretrained one;
// under exact it carries the residuals.
void ExpectTheExportIsTheRound(Federation& f, const std::string& merge) {
  const fs::path out = f.dir() / "export";
  auto r = RunCommand(fmt::format("{} export --db {} --out {}", BinaryPath("estuary-server").string(), f.db().string(),
                                  out.string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(fmt::format("({} merge): a PEFT adapter (r 8, alpha 16, q_proj,k_proj,v_proj,o_proj)", merge)),
            std::string::npos)
      << r.output;
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto last = store->LastCommittedRound();
  ASSERT_TRUE(last.ok() && last->has_value());
  auto path = store->CheckpointFor((*last)->round);
  ASSERT_TRUE(path.ok() && path->has_value());
  auto checkpoint = models::LoadCheckpoint(**path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  auto config = models::LlamaPreset("llama-tiny");
  ASSERT_TRUE(config.ok());
  auto layout = models::MakeLoraGlobalLayout(*config, LoraOf(8));
  ASSERT_TRUE(layout.ok());
  const std::span<const float> global(checkpoint->data);
  const auto base_part = global.first(layout->adapter_offset()), adapter_part = global.subspan(layout->adapter_offset());

  auto base = models::LoadHfCheckpoint(out / "base", 2);
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  ASSERT_EQ(base->parameters().size(), base_part.size());
  EXPECT_TRUE(std::equal(base_part.begin(), base_part.end(), base->parameters().begin()));
  auto initial = models::LoraInitialModel("llama-tiny", LoraOf(8), 2017, {});  // the server's default seed
  ASSERT_TRUE(initial.ok()) << initial.status().ToString();
  const bool pretrained = std::equal(base_part.begin(), base_part.end(), initial->values.begin());
  EXPECT_EQ(pretrained, merge != "exact") << merge;

  auto lora = models::ReadLoraConfig(out / "adapter");
  ASSERT_TRUE(lora.ok()) << lora.status().ToString();
  EXPECT_EQ(lora->rank, 8);
  EXPECT_EQ(lora->alpha, 16.0f);
  auto adapted = models::LoraLlama::Create(std::move(*base), *lora);
  ASSERT_TRUE(adapted.ok()) << adapted.status().ToString();
  ASSERT_TRUE(models::LoadLoraAdapter(out / "adapter", *adapted).ok());
  ASSERT_EQ(adapted->parameters().size(), adapter_part.size());
  EXPECT_TRUE(std::equal(adapter_part.begin(), adapter_part.end(), adapted->parameters().begin()));

  auto merged = models::LoadHfCheckpoint(out / "merged", 2);
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();
  std::vector<int32_t> tokens(2 * 16);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t((i * 37 + 11) % size_t(config->vocab_size));
  std::vector<float> via_adapter(tokens.size() * size_t(config->vocab_size)), via_merged(via_adapter.size());
  ASSERT_TRUE(adapted->Forward(tokens.data(), 2, 16, via_adapter.data()).ok());
  ASSERT_TRUE(merged->Forward(tokens.data(), 2, 16, via_merged.data()).ok());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < via_adapter.size(); ++i) {
    diff = std::max(diff, double(std::abs(via_adapter[i] - via_merged[i])));
    scale = std::max(scale, double(std::abs(via_merged[i])));
  }
  EXPECT_LE(diff / scale, 1e-5) << merge;
}

// A lora federation with the real binaries: a text site trains and uploads
// its adapter factors; a site whose adapters have another rank, and one that
// sends a full delta, are refused with one line naming site, module and
// field, and neither reaches the aggregate.
TEST(Federation, ALoraFederationRefusesUploadsThatDoNotFitItsAdapters) {
  Federation f;
  for (const char* name : {"library", "site-rank", "site-full"}) f.Issue(name);
  const fs::path text = f.dir() / "text";
  fs::create_directories(text);
  {
    std::ofstream out(text / "proverbs");
    for (int i = 0; i < 200; ++i) out << "a stitch in time saves nine, number " << i << "\n%\n";
  }
  const uint16_t port = f.StartServer(
      1, 3, {"--model", "llama-tiny", "--eval-data", text.string(), "--optimizer", "adamw", "--lr", "0.003", "--batch",
             "4", "--seq-len", "32", "--max-local-steps", "3", "--eval-windows", "8", "--update-kind", "lora",
             "--lora-rank", "8", "--lora-alpha", "16", "--lora-merge", "exact"});
  ASSERT_NE(port, 0) << f.ServerLog();
  std::map<std::string, std::unique_ptr<RawClient>> raw;
  for (const char* name : {"site-rank", "site-full"}) {
    auto client = RawClient::Connect(port, f.Files(name));
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    ASSERT_TRUE((*client)->Handshake().ok());
    raw[name] = std::move(client).value();
  }
  auto good = f.StartClient("library", port, text);
  std::vector<float> global;
  auto start = raw["site-rank"]->AwaitRound(&global);
  ASSERT_TRUE(start.ok()) << start.status().ToString();
  auto full_start = raw["site-full"]->AwaitRound(&global);
  ASSERT_TRUE(full_start.ok());
  EXPECT_EQ(start->task().update_kind(), v1::UPDATE_LORA);
  EXPECT_EQ(start->task().lora().rank(), 8u);
  auto config = models::LlamaPreset("llama-tiny");
  ASSERT_TRUE(config.ok());
  auto layout = models::MakeLoraGlobalLayout(*config, LoraOf(8));
  ASSERT_TRUE(layout.ok());
  ASSERT_EQ(global.size(), layout->global.total_elements);  // base + adapter travel as one model

  {  // Rank-4 adapters where the federation trains rank 8.
    auto rank4 = models::MakeLoraGlobalLayout(*config, LoraOf(4));
    ASSERT_TRUE(rank4.ok());
    v1::Envelope envelope;
    auto* begin = envelope.mutable_update_begin();
    begin->set_round(start->round());
    begin->set_kind(v1::UPDATE_LORA);
    begin->set_num_examples(100000);
    begin->set_train_loss(1.0);
    *begin->mutable_manifest() = proto::ToProto(rank4->adapter);
    auto& c = *raw["site-rank"];
    ASSERT_TRUE(c.Send(envelope).ok());
    auto reply = c.Receive();
    ASSERT_TRUE(reply.ok() && reply->has_error()) << reply.status().ToString();
    EXPECT_EQ(reply->error().code(), v1::Error::BAD_MESSAGE);
    EXPECT_EQ(reply->error().message(),
              "lora update from site-rank: module base_model.model.model.layers.0.self_attn.q_proj: lora_A rank 4, "
              "the federation's is 8");
    EXPECT_TRUE(c.Closed());
  }
  {  // A full delta in a lora federation.
    auto& c = *raw["site-full"];
    ASSERT_TRUE(c.Send(MakeUpdateBegin(*full_start, std::vector<float>(global.size(), 1e6f), 100000)).ok());
    auto reply = c.Receive();
    ASSERT_TRUE(reply.ok() && reply->has_error());
    EXPECT_EQ(reply->error().message(), "update kind full from site-full, but this federation takes lora");
    EXPECT_TRUE(c.Closed());
  }
  EXPECT_EQ(good->Wait(), 0) << f.ClientLog("library");
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();

  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto round = store->GetRound(1);
  ASSERT_TRUE(round.ok() && round->has_value());
  EXPECT_EQ((*round)->state, server::RoundState::kCommitted);
  EXPECT_EQ((*round)->updates_received, 1u);
  const uint64_t adapter_bytes = layout->adapter.byte_size();
  EXPECT_EQ((*round)->bytes_up, adapter_bytes);
  EXPECT_NE((*round)->detail.find(fmt::format("update kind lora (lora-exact): {} bytes per update", adapter_bytes)),
            std::string::npos)
      << (*round)->detail;
  auto p = ParticipationsByName(*store, 1);
  EXPECT_EQ(p["library"].status, "committed");
  EXPECT_EQ(p["library"].bytes_up, adapter_bytes);
  EXPECT_EQ(p["site-rank"].status, "rejected");
  EXPECT_NE(p["site-rank"].detail.find("lora_A rank 4"), std::string::npos) << p["site-rank"].detail;
  EXPECT_EQ(p["site-full"].status, "rejected");

  // One rank-8 site under exact: nothing to truncate, so the base is kept bit
  // for bit and only the adapter moved.
  auto path = store->CheckpointFor(1);
  ASSERT_TRUE(path.ok() && path->has_value());
  auto checkpoint = models::LoadCheckpoint(**path);
  ASSERT_TRUE(checkpoint.ok());
  ASSERT_EQ(checkpoint->data.size(), global.size());
  const size_t base = layout->base.total_elements;
  EXPECT_TRUE(std::equal(global.begin(), global.begin() + base, checkpoint->data.begin()));
  EXPECT_FALSE(std::equal(global.begin() + base, global.end(), checkpoint->data.begin() + base));
  for (float v : checkpoint->data) ASSERT_LT(std::abs(v), 100.0f);  // nothing of the 1e6 delta
}

// A lora federation's configuration: each mistake is one line naming the key
// (or the base model's file and tensor), and the server does not start.
TEST(Federation, BadLoraConfigurationGetsOneLineNamingTheKey) {
  Federation f;
  const std::string server = BinaryPath("estuary-server").string();
  const std::string common = fmt::format("{} serve --listen 127.0.0.1:0 --cert {} --key {} --ca {} --db {}", server,
                                         f.Files("server").cert.string(), f.Files("server").key.string(),
                                         f.Files("server").ca.string(), (f.dir() / "x.db").string());
  // A base checkpoint of another size: llama-small's tensors under llama-tiny's names.
  const fs::path wrong_base = f.dir() / "small.safetensors";
  auto small = models::InitialModel("llama-small", 1);
  ASSERT_TRUE(small.ok());
  ASSERT_TRUE(models::SaveCheckpoint(wrong_base, small->manifest, small->values).ok());
  const std::pair<std::string, std::string> cases[] = {
      {"--model mlp --update-kind lora", "update_kind = lora needs a language model (llama-*), not 'mlp'"},
      {"--model llama-tiny --update-kind lora --lora-merge median", "lora_merge = 'median'"},
      {"--model llama-tiny --update-kind lora --lora-merge naive --lora-mixed-ranks",
       "only exact merges adapters of mixed ranks"},
      {"--model llama-tiny --update-kind lora --lora-targets q_proj,qkv", "target module 'qkv'"},
      {"--model llama-tiny --update-kind lora --lora-rank 0", "lora_rank = 0"},
      {"--model llama-tiny --update-kind delta", "--update-kind: delta not in {full,lora}"},
      {"--model llama-tiny --base-model " + wrong_base.string(), "only a lora federation starts from a base model"},
      {"--model llama-tiny --update-kind lora --base-model " + wrong_base.string(),
       wrong_base.string() + ": tensor model.embed_tokens.weight is f32 [256, 384], the model wants f32 [256, 128]"},
  };
  for (const auto& [flags, expected] : cases) {
    auto r = RunCommand(common + " " + flags);
    EXPECT_NE(r.exit_code, 0) << flags;
    EXPECT_NE(r.output.find(expected), std::string::npos) << flags << ": " << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << flags << ": " << r.output;
  }
}

// Sites that keep the global model they trained from get, after round 1,
// only the tensors that changed, patch them into the model they hold and
// check the whole buffer's checksum: under naive the adapter; under exact
// also the residual folded into the q/k/v/o weights, as its factors (the two
// sites' and the merged adapter's, rank 8 + 8 + 8), which the site adds to
// the weights it holds; under frozen-a the B factors alone.
TEST(Federation, LoraSitesDownloadOnlyTheTensorsThatChanged) {
  auto config = models::LlamaPreset("llama-tiny");
  ASSERT_TRUE(config.ok());
  auto layout = models::MakeLoraGlobalLayout(*config, LoraOf(8));
  ASSERT_TRUE(layout.ok());
  const uint64_t full = layout->global.byte_size(), adapter = layout->adapter.byte_size();
  uint64_t adapted = 0, residual_factors = 0;  // the base weights under the adapters, and exact's residuals in them
  for (const auto& spec : layout->base.tensors) {
    for (const char* m : {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"}) {
      if (!spec.name.ends_with(m)) continue;
      adapted += spec.numel() * sizeof(float);
      residual_factors += 4 * 24 * uint64_t(spec.shape[0] + spec.shape[1]);
    }
  }
  EXPECT_EQ(adapted, 786432u);
  EXPECT_EQ(residual_factors, 344064u);  // 0.44 of the weights they change
  const uint64_t b_only = models::LoraUploadManifest(layout->adapter, true).byte_size();
  for (const std::string merge : {"naive", "exact", "frozen-a"}) {
    Federation f;
    f.Issue("site-a");
    f.Issue("site-b");
    const fs::path text = f.dir() / "text";
    fs::create_directories(text);
    {
      std::ofstream out(text / "proverbs");
      for (int i = 0; i < 200; ++i) out << "a stitch in time saves nine, number " << i << "\n%\n";
    }
    const uint16_t port = f.StartServer(
        3, 2, {"--model", "llama-tiny", "--eval-data", text.string(), "--optimizer", "adamw", "--lr", "0.003",
               "--batch", "4", "--seq-len", "32", "--max-local-steps", "2", "--eval-windows", "4", "--update-kind",
               "lora", "--lora-rank", "8", "--lora-alpha", "16", "--lora-merge", merge});
    ASSERT_NE(port, 0) << f.ServerLog();
    auto a = f.StartClient("site-a", port, text);
    auto b = f.StartClient("site-b", port, text);
    EXPECT_EQ(a->Wait(), 0) << f.ClientLog("site-a");
    EXPECT_EQ(b->Wait(), 0) << f.ClientLog("site-b");
    ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
    auto store = f.OpenStore();
    ASSERT_TRUE(store);
    auto rounds = store->Rounds();
    ASSERT_TRUE(rounds.ok());
    ASSERT_EQ(rounds->size(), 3u) << merge;
    EXPECT_EQ((*rounds)[0].bytes_down, 2 * full) << merge;
    for (size_t r = 1; r < 3; ++r) {
      EXPECT_EQ((*rounds)[r].state, server::RoundState::kCommitted) << merge;
      EXPECT_EQ((*rounds)[r].updates_received, 2u) << merge << " round " << r + 1;
      // Two rank-8 sites: exact's K = 16 > 8 leaves a residual in the base every round.
      // Frozen-a: A never changes, so only the B factors travel.
      const uint64_t per_site = merge == "naive" ? adapter : merge == "exact" ? adapter + residual_factors : b_only;
      EXPECT_EQ((*rounds)[r].bytes_down, 2 * per_site) << merge << " round " << r + 1;
      EXPECT_LT((*rounds)[r].bytes_down, full) << merge;
    }
    ExpectTheExportIsTheRound(f, merge);
  }
}

TEST(Federation, ARestartedServerResumesAfterTheLastCommittedRound) {
  Federation f;
  f.Issue("site-a");
  {
    const uint16_t port = f.StartServer(1, 1);
    auto a = f.StartClient("site-a", port);
    EXPECT_EQ(a->Wait(), 0);
    ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  }
  std::string checksum_after_round_1;
  {
    auto store = f.OpenStore();
    auto r1 = store->GetRound(1);
    ASSERT_TRUE(r1.ok() && r1->has_value());
    checksum_after_round_1 = (*r1)->global_checksum;
  }
  // Same database, three rounds in all: it must run rounds 2 and 3 only.
  const uint16_t port = f.StartServer(3, 1);
  auto a = f.StartClient("site-a", port);
  EXPECT_EQ(a->Wait(), 0);
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  EXPECT_NE(f.ServerLog().find("resumed after round 1"), std::string::npos) << f.ServerLog();
  auto store = f.OpenStore();
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 3u);
  EXPECT_EQ((*rounds)[0].global_checksum, checksum_after_round_1);
  EXPECT_EQ((*rounds)[2].model_version, 3u);

  // Started again with nothing left to run, it says where it resumed, tells
  // the sites of its round log that the federation is over as they
  // reconnect, and then exits cleanly. It may have died between the last
  // commit and a site reading that: stopping at once left such a site
  // reconnecting for ever (AClientReconnectsAfterTheServerCrashes, killed
  // late under load).
  const uint16_t again = f.StartServer(3, 1);
  ASSERT_NE(again, 0);
  auto late = f.StartClient("site-a", again);
  EXPECT_EQ(late->Wait(), 0) << f.ClientLog("site-a");
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  EXPECT_NE(f.ServerLog().find("resumed after round 3"), std::string::npos) << f.ServerLog();
  EXPECT_NE(f.ServerLog().find("telling the 1 sites of the round log as they reconnect"), std::string::npos)
      << f.ServerLog();
  EXPECT_NE(f.ClientLog("site-a").find("federation complete"), std::string::npos) << f.ClientLog("site-a");
  EXPECT_EQ(f.ServerLog().find("terminate called"), std::string::npos) << f.ServerLog();

  // A site that never comes back holds it no longer than --idle-timeout.
  ASSERT_NE(f.StartServer(3, 1, {"--idle-timeout", "1"}), 0);
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  EXPECT_NE(f.ServerLog().find("1 sites of the round log did not reconnect"), std::string::npos) << f.ServerLog();
}

// FedAdam's moments live in the strategy and go into every checkpoint. A
// federation stopped after round 1 and restarted must reach exactly the
// round-2 model of one that never stopped; without the moments it would not.
TEST(Federation, FedAdamStateSurvivesARestartBitForBit) {
  const std::vector<std::string> fedadam = {"--strategy", "fedadam", "--server-lr", "0.01"};
  std::string continuous;
  {
    Federation f;
    f.Issue("site-a");
    const uint16_t port = f.StartServer(2, 1, fedadam);
    auto a = f.StartClient("site-a", port);
    EXPECT_EQ(a->Wait(), 0);
    ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
    auto round = f.OpenStore()->GetRound(2);
    ASSERT_TRUE(round.ok() && round->has_value());
    continuous = (*round)->global_checksum;
  }
  Federation f;
  f.Issue("site-a");
  for (uint64_t rounds : {1, 2}) {
    const uint16_t port = f.StartServer(rounds, 1, fedadam);
    auto a = f.StartClient("site-a", port);
    EXPECT_EQ(a->Wait(), 0);
    ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  }
  EXPECT_TRUE(std::filesystem::exists(f.db().string() + ".checkpoints/global-r00001.safetensors.strategy"));
  auto round = f.OpenStore()->GetRound(2);
  ASSERT_TRUE(round.ok() && round->has_value());
  EXPECT_EQ((*round)->global_checksum, continuous);
}

// DP-FedAvg over real TLS with adaptive clipping: the server stopped after
// round 1 and started again continues the clip norm from its checkpoint and
// the ε from its round log, and a budget between ε after 2 and after 3 rounds
// ends the federation cleanly before round 3. Two of two sites each round:
// q = 1.
TEST(Federation, ADpFederationResumesItsClipAndItsEpsilonAndStopsAtTheBudget) {
  constexpr double kZ = 1.0, kDelta = 1e-5;
  auto two = privacy::EpsilonAfterRounds(1.0, kZ, 2, kDelta);
  auto three = privacy::EpsilonAfterRounds(1.0, kZ, 3, kDelta);
  ASSERT_TRUE(two.ok() && three.ok());
  const std::vector<std::string> dp = {"--dp-noise-multiplier", "1", "--dp-clip", "0.5", "--dp-adaptive-clip",
                                       "--dp-clipped-count-stddev", "1", "--dp-delta", "1e-5", "--dp-max-epsilon",
                                       fmt::format("{}", (two->epsilon + three->epsilon) / 2)};
  Federation f;
  f.Issue("site-a");
  f.Issue("site-b");
  for (uint64_t rounds : {1, 3}) {
    const uint16_t port = f.StartServer(rounds, 2, dp);
    auto a = f.StartClient("site-a", port);
    auto b = f.StartClient("site-b", port);
    EXPECT_EQ(a->Wait(), 0);
    EXPECT_EQ(b->Wait(), 0);
    ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  }
  EXPECT_NE(f.ServerLog().find("federation stops before round 3: ε would reach"), std::string::npos)
      << f.ServerLog();
  auto store = f.OpenStore();
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 2u) << "round 3 never opened";
  for (const auto& r : *rounds) {
    ASSERT_EQ(r.state, server::RoundState::kCommitted);
    ASSERT_TRUE(r.privacy.has_value()) << r.round;
    auto expected = privacy::EpsilonAfterRounds(1.0, kZ, int64_t(r.round), kDelta);
    ASSERT_TRUE(expected.ok());
    EXPECT_DOUBLE_EQ(r.privacy->epsilon, expected->epsilon) << r.round;
    EXPECT_EQ(r.strategy, "fedavg+dp");
    // z_Δ = (1 − (2σ_b)⁻²)^(−½) for z = 1, σ_b = 1: the sum's share of the budget.
    EXPECT_NEAR(r.privacy->noise_stddev, r.privacy->clip * 1.1547005383792515, 1e-12) << r.round;
  }
  EXPECT_EQ((*rounds)[0].privacy->clip, 0.5);
  // Round 2 ran in the restarted server: a clip norm back at 0.5 would mean
  // the adaptive state was lost (the count's noise moves it every round).
  EXPECT_NE((*rounds)[1].privacy->clip, 0.5);

  const std::string server_bin = BinaryPath("estuary-server").string();
  auto list = RunCommand(fmt::format("{} rounds list --db {}", server_bin, f.db().string()));
  ASSERT_EQ(list.exit_code, 0) << list.output;
  EXPECT_NE(list.output.find(fmt::format("{:.4g}", (*rounds)[1].privacy->epsilon)), std::string::npos)
      << list.output;
  EXPECT_NE(list.output.find("at δ = 1e-05"), std::string::npos) << list.output;
}

// Nonsense DP settings, as flags or as TOML keys, are one line naming the key
// and the value, from either program.
TEST(Federation, NonsenseDpSettingsGetOneLineNamingTheKeyAndTheValue) {
  Federation f;
  const std::string sim = BinaryPath("estuary-sim").string();
  for (const auto& [flags, expected] : {
           std::pair<std::string, std::string>{"--dp-noise-multiplier -1", "dp_noise_multiplier = -1: must be"},
           {"--dp-noise-multiplier nan", "dp_noise_multiplier = nan: must be"},
           {"--dp-noise-multiplier 1 --dp-delta 1", "dp_delta = 1: must be in (0, 1)"},
           {"--dp-noise-multiplier 1 --dp-clip 0", "dp_clip = 0: must be > 0"},
           {"--dp-max-epsilon 3", "dp_max_epsilon without dp_noise_multiplier"},
           {"--dp-noise-multiplier 1 --dp-adaptive-clip --dp-clipped-count-stddev 0.2",
            "dp_clipped_count_stddev = 0.2: must be above dp_noise_multiplier / 2 = 0.5"},
       }) {
    auto r = RunCommand(fmt::format("{} --quiet --data {} {}", sim, (f.dir() / "none").string(), flags));
    EXPECT_NE(r.exit_code, 0) << flags;
    EXPECT_NE(r.output.find(expected), std::string::npos) << flags << ": " << r.output;
    // The simulator starts a new line first, past where its progress bar would be.
    const std::string message = r.output.substr(r.output.find_first_not_of('\n'));
    EXPECT_EQ(std::count(message.begin(), message.end(), '\n'), 1) << r.output;
  }
  const fs::path toml = f.dir() / "dp.toml";
  std::ofstream(toml) << "dp_noise_multiplier = 1.0\ndp_target_quantile = 1.5\n";
  auto r = RunCommand(fmt::format("{} serve --config {} --cert {} --key {} --ca {} --db {}",
                                  BinaryPath("estuary-server").string(), toml.string(),
                                  f.Files("server").cert.string(), f.Files("server").key.string(),
                                  f.Files("server").ca.string(), (f.dir() / "x.db").string()));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("dp_target_quantile = 1.5: must be in [0, 1]"), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
}

// The server is killed (SIGKILL) at some instant after round 1 committed and
// restarted on the same port; the client reconnects on its own and the
// federation finishes from the last committed round.
TEST(Federation, AClientReconnectsAfterTheServerCrashes) {
  Federation f;
  f.Issue("site-a");
  const uint16_t port = FreePort();
  const std::string listen = fmt::format("127.0.0.1:{}", port);
  ASSERT_EQ(f.StartServer(4, 1, {}, listen), port);
  auto client = f.StartClient("site-a", port);
  ASSERT_TRUE(f.AwaitCommitted(1)) << f.ServerLog();
  f.server().Kill();
  ASSERT_EQ(f.StartServer(4, 1, {}, listen), port);
  EXPECT_EQ(client->Wait(), 0);
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  EXPECT_NE(f.ServerLog().find("resumed after round"), std::string::npos) << f.ServerLog();
  auto store = f.OpenStore();
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok());
  ASSERT_EQ(rounds->size(), 4u);
  for (const auto& r : *rounds) EXPECT_EQ(r.state, server::RoundState::kCommitted) << r.round;
}

// Every program's --help shows each flag's default, the federation's flags
// the same in the server and the simulator.
TEST(Federation, EveryHelpShowsTheDefaults) {
  const std::pair<std::string, std::vector<std::string>> cases[] = {
      {"estuary-server serve", {"--rounds UINT=20", "--min-clients UINT=10", "--epochs UINT=5", "--strategy TEXT=fedavg",
                                "--lora-targets TEXT=q_proj,k_proj,v_proj,o_proj", "--exit-when-done",
                                "--dp-noise-multiplier FLOAT=0", "--dp-clip FLOAT=1", "--dp-delta FLOAT=1e-05",
                                "--dp-max-epsilon FLOAT=0", "--dp-adaptive-clip=false"}},
      {"estuary-sim", {"--clients UINT=100", "--rounds UINT=20", "--epochs UINT=5", "--strategy TEXT=fedavg",
                       "--threads UINT=2", "--max-norm-over-median FLOAT=10", "--dp-noise-multiplier FLOAT=0",
                       "--dp-target-quantile FLOAT=0.5", "--dp-clip-lr FLOAT=0.2"}},
      {"estuary-client", {"--server TEXT=127.0.0.1:7443", "--device TEXT=cpu", "--blas-threads INT=1",
                          "--rank-timeout FLOAT=60"}},
  };
  for (const auto& [program, expected] : cases) {
    const std::string binary = program.substr(0, program.find(' '));
    const std::string rest = program.size() > binary.size() ? program.substr(binary.size()) : "";
    auto r = RunCommand(BinaryPath(binary).string() + rest + " --help");
    EXPECT_EQ(r.exit_code, 0) << program;
    for (const std::string& flag : expected) {
      EXPECT_NE(r.output.find(flag), std::string::npos) << program << ": " << flag << "\n" << r.output;
    }
  }
}

TEST(Federation, BadConfigurationGetsOneLineNamingTheFile) {
  Federation f;
  const std::string server = BinaryPath("estuary-server").string();
  const std::string client = BinaryPath("estuary-client").string();
  const fs::path bad_toml = f.dir() / "bad.toml";
  std::ofstream(bad_toml) << "rounds = 5\nlisten = \"127.0.0.1:0\n";
  auto r = RunCommand(fmt::format("{} serve --config {}", server, bad_toml.string()));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find(bad_toml.string() + ":2"), std::string::npos) << r.output;

  const fs::path unknown = f.dir() / "unknown.toml";
  std::ofstream(unknown) << "roundz = 5\n";
  r = RunCommand(fmt::format("{} serve --config {}", server, unknown.string()));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("unknown key 'roundz'"), std::string::npos) << r.output;

  // Once (fuzzing): a flag given a string in the file made CLI11 throw
  // std::invalid_argument past the config reader, and the server abort.
  const fs::path flag_string = f.dir() / "flag.toml";
  std::ofstream(flag_string) << "exit_when_done = \"adamw\"\n";
  r = RunCommand(fmt::format("{} serve --config {}", server, flag_string.string()));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("key 'exit_when_done' is a flag; it must be true or false"), std::string::npos)
      << r.output;

  const fs::path missing_key = f.dir() / "nope.key";
  r = RunCommand(fmt::format("{} serve --cert {} --key {} --ca {} --db {}", server,
                             f.Files("server").cert.string(), missing_key.string(), f.Files("server").ca.string(),
                             (f.dir() / "x.db").string()));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find(missing_key.string()), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;

  // A federation file is the whole federation: no federation flag beside it; a
  // bad one is named with its line; an unknown log level is refused.
  const fs::path federation = f.dir() / "federation.txtpb";
  std::ofstream(federation) << "task {\n  model: \"cnn\"\n  epochs: many\n}\n";
  const std::string serve = fmt::format("{} serve --cert {} --key {} --ca {} --db {}", server,
                                        f.Files("server").cert.string(), f.Files("server").key.string(),
                                        f.Files("server").ca.string(), (f.dir() / "x.db").string());
  for (const auto& [flags, expected] :
       {std::pair<std::string, std::string>{"--federation " + federation.string() + " --epochs 3",
                                            "--epochs with --federation " + federation.string()},
        {"--federation " + federation.string(), federation.string() + ":3:"},
        {"--log-level loud", "--log-level: loud not in"},
        {"--strategy fedadam --update-kind lora --model llama-tiny", "strategy = fedadam with update_kind = lora"}}) {
    r = RunCommand(serve + " " + flags);
    EXPECT_NE(r.exit_code, 0) << flags;
    EXPECT_NE(r.output.find(expected), std::string::npos) << flags << ": " << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << flags << ": " << r.output;
  }

  // A revocation list that is not one, and one another CA signed.
  TempDir foreign;
  ASSERT_TRUE(crypto::InitCa(foreign.path(), "foreign-ca").ok());
  ASSERT_TRUE(crypto::RenewCrl(foreign.path()).ok());
  for (const auto& [crl, expected] : {std::pair<fs::path, std::string>{f.Files("server").cert, "cannot read a certificate revocation list"},
                                      {foreign / "crl.pem", "not issued and signed by the CA"}}) {
    r = RunCommand(fmt::format("{} serve --cert {} --key {} --ca {} --crl {} --db {}", server,
                               f.Files("server").cert.string(), f.Files("server").key.string(),
                               f.Files("server").ca.string(), crl.string(), (f.dir() / "x.db").string()));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find(crl.string() + ": " + expected), std::string::npos) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  }
  // Revoking a site that has no certificate here.
  r = RunCommand(fmt::format("{} certs revoke --dir {} --name site-zz", server, f.certs().string()));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find((f.certs() / "site-zz.pem").string() + ": no such file"), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;

  f.Issue("site-a");
  const auto files = f.Files("site-a");
  r = RunCommand(fmt::format("{} --server 127.0.0.1:1 --cert {} --key {} --ca {} --data {}", client,
                             files.cert.string(), files.key.string(), files.ca.string(),
                             (f.dir() / "no-such-dir").string()));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("no-such-dir"), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;

  // A client's config file counts like its flags: a bad blas_threads there is refused.
  const fs::path client_toml = f.dir() / "client.toml";
  std::ofstream(client_toml) << "blas_threads = 0\n";
  r = RunCommand(fmt::format("{} --config {} --server 127.0.0.1:1 --cert {} --key {} --ca {} --data {}", client,
                             client_toml.string(), files.cert.string(), files.key.string(), files.ca.string(),
                             f.data().string()));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--blas-threads 0: must be >= 1"), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;

  // A corrupt data directory: a truncated image file.
  const fs::path corrupt = f.dir() / "corrupt";
  fs::copy(f.data(), corrupt);
  fs::resize_file(corrupt / "train-images-idx3-ubyte", 1000);
  r = RunCommand(fmt::format("{} --server 127.0.0.1:1 --cert {} --key {} --ca {} --data {}", client,
                             files.cert.string(), files.key.string(), files.ca.string(), corrupt.string()));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("train-images-idx3-ubyte"), std::string::npos) << r.output;

  // A device or precision this site cannot train on.
  for (const auto& [flags, expected] : {std::pair<std::string, std::string>{"--device tpu", "--device 'tpu'"},
                                        {"--precision bf16", "the CPU backend trains in fp32"},
                                        {"--precision fp8", "--precision 'fp8'"}}) {
    r = RunCommand(fmt::format("{} --server 127.0.0.1:1 --cert {} --key {} --ca {} --data {} {}", client,
                               files.cert.string(), files.key.string(), files.ca.string(), f.data().string(), flags));
    EXPECT_NE(r.exit_code, 0) << flags;
    EXPECT_NE(r.output.find(expected), std::string::npos) << flags << ": " << r.output;
    // The simulator starts a new line first, past where its progress bar would be.
    const std::string message = r.output.substr(r.output.find_first_not_of('\n'));
    EXPECT_EQ(std::count(message.begin(), message.end(), '\n'), 1) << r.output;
  }
}

}  // namespace
}  // namespace estuary::testing

namespace estuary::testing {
namespace {

// The harness's own guarantee: a child that does not end is killed at the
// limit, so a test waiting on it ends by itself.
TEST(Harness, AChildThatDoesNotEndIsKilledAtTheLimit) {
  TempDir dir;
  const auto start = std::chrono::steady_clock::now();
  ChildProcess sleeper({"/bin/sleep", "60"}, dir.path() / "sleep.log");
  EXPECT_EQ(sleeper.Wait(std::chrono::seconds(1)), 128 + SIGKILL);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  ChildProcess quick({"/bin/sh", "-c", "exit 3"}, dir.path() / "quick.log");
  EXPECT_EQ(quick.Wait(std::chrono::seconds(30)), 3);
}

}  // namespace
}  // namespace estuary::testing
