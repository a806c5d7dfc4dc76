// A site's checks of the keys the server relays to it in SecAgg+
// (client/secagg_site.h): it takes its neighbours' keys only signed, over
// this round's setup and the neighbour's id, by distinct site certificates of
// the federation other than its own. A server that substitutes a key (the
// attack that would let it open the shares sealed to it), replays last
// round's, relays keys unsigned, or signs two neighbours' with one
// certificate is refused in one line before the site shares anything. And
// its consistency check: it reveals its shares only on its neighbours' valid
// signatures over the survivor set it signed itself.
#include "client/secagg_site.h"

#include <gtest/gtest.h>

#include <map>
#include <optional>

#include "crypto/certs.h"
#include "secagg/server.h"
#include "secagg/wire.h"
#include "tests/crypto/test_dir.h"

namespace estuary::client {
namespace {

constexpr uint64_t kDimension = 8;

class SecAggSiteKeys : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(crypto::InitCa(dir()).ok());
    for (const char* name : {"site-a", "site-b", "site-c", "site-x"}) {
      ASSERT_TRUE(crypto::IssueCertificate(dir(), name).ok());
      auto identity = SecAggIdentity::FromFiles(
          {.cert = dir() / (std::string(name) + ".pem"), .key = dir() / (std::string(name) + ".key"),
           .ca = dir() / "ca.pem"});
      ASSERT_TRUE(identity.ok()) << identity.status().ToString();
      identities_.push_back(*identity);
    }
  }
  const std::filesystem::path& dir() const { return tmp_.path(); }

  secagg::ProtocolConfig Config(uint64_t round) const {
    secagg::Key32 seed{};
    seed[0] = uint8_t(round);
    return {.round = round, .sites = 3, .degree = 2, .threshold = 2, .bits = 32, .dimension = kDimension,
            .graph_seed = seed};
  }
  v1::RoundStart Start(uint64_t round, uint32_t site) const {
    v1::RoundStart start;
    start.set_round(round);
    start.mutable_manifest()->set_total_elements(kDimension);
    start.mutable_task()->set_update_kind(v1::UPDATE_FULL);
    *start.mutable_secagg() = secagg::ToProto(Config(round), site, 1.0, 1000.0, 10);
    return start;
  }
  // Sites 0, 1, 2 (site-a, -b, -c) start round `round`: their sites and advertisements.
  void StartRound(uint64_t round) {
    sites_.clear();
    adverts_.clear();
    for (uint32_t u = 0; u < 3; ++u) {
      v1::Envelope advertise;
      auto site = SecAggSite::Start(Start(round, u), identities_[u], &advertise);
      ASSERT_TRUE(site.ok()) << site.status().ToString();
      sites_.push_back(std::move(*site));
      adverts_.push_back(advertise.secagg_advertise());
    }
  }
  // What an honest server relays to site 0: sites 1 and 2's keys as they advertised them.
  v1::SecAggKeys Relayed(uint64_t round) const {
    v1::SecAggKeys keys;
    keys.set_round(round);
    for (uint32_t u : {1u, 2u}) {
      v1::SecAggPeerKeys& peer = *keys.add_neighbours();
      peer.set_site(u);
      peer.set_mask_public_key(adverts_[u].mask_public_key());
      peer.set_share_public_key(adverts_[u].share_public_key());
      peer.set_signature(adverts_[u].signature());
      peer.set_certificate(adverts_[u].certificate());
    }
    return keys;
  }
  void ExpectRefused(const v1::SecAggKeys& keys, const std::string& because) {
    auto shares = sites_[0]->OnKeys(keys);
    ASSERT_FALSE(shares.ok()) << "accepted keys " << because;
    EXPECT_NE(shares.status().message().find(because), std::string::npos) << shares.status().message();
    EXPECT_EQ(shares.status().message().find('\n'), std::string::npos);
  }

  std::vector<SecAggIdentity> identities_;
  std::vector<std::unique_ptr<SecAggSite>> sites_;
  std::vector<v1::SecAggAdvertise> adverts_;

 private:
  crypto::testing::TempDir tmp_;
};

TEST_F(SecAggSiteKeys, KeysAsTheirSitesSignedThemAreTaken) {
  StartRound(4);
  EXPECT_FALSE(adverts_[1].signature().empty());
  auto shares = sites_[0]->OnKeys(Relayed(4));
  ASSERT_TRUE(shares.ok()) << shares.status().ToString();
  EXPECT_EQ(shares->secagg_shares().envelopes_size(), 2);
}

TEST_F(SecAggSiteKeys, ASubstitutedKeyIsRefused) {
  StartRound(4);
  v1::SecAggKeys keys = Relayed(4);
  // The server's own key pair in site 1's place: site-x's advertisement, which the server holds.
  v1::Envelope x;
  ASSERT_TRUE(SecAggSite::Start(Start(4, 1), identities_[3], &x).ok());
  keys.mutable_neighbours(0)->set_mask_public_key(x.secagg_advertise().mask_public_key());
  ExpectRefused(keys, "site 1's keys: crypto: the signature of 'site-b' does not verify");
}

TEST_F(SecAggSiteKeys, LastRoundsKeysAreRefused) {
  StartRound(3);
  const v1::SecAggKeys old = Relayed(3);
  StartRound(4);
  v1::SecAggKeys keys = Relayed(4);
  *keys.mutable_neighbours(1) = old.neighbours(1);
  ExpectRefused(keys, "site 2's keys: crypto: the signature of 'site-c' does not verify");
}

TEST_F(SecAggSiteKeys, UnsignedKeysAreRefused) {
  StartRound(4);
  v1::SecAggKeys keys = Relayed(4);
  keys.mutable_neighbours(1)->clear_signature();
  ExpectRefused(keys, "site 2's keys come unsigned");
}

TEST_F(SecAggSiteKeys, OneCertificateForTwoNeighboursOrTheSitesOwnIsRefused) {
  StartRound(4);
  const secagg::ProtocolConfig config = Config(4);
  // Keys signed for their id, but by a certificate that already signed a neighbour's, or by the site's own.
  for (const auto& [holder, because] : {std::pair{1, "signed by 'site-b', who signed another neighbour's too"},
                                        std::pair{0, "signed by 'site-a', this site's own certificate"}}) {
    v1::SecAggKeys keys = Relayed(4);
    v1::SecAggPeerKeys& peer = *keys.mutable_neighbours(1);
    auto parsed = secagg::FromProto(keys);
    ASSERT_TRUE(parsed.ok());
    const crypto::SiteSigner& signer = identities_[size_t(holder)].signer;
    peer.set_signature(signer.Sign(secagg::AdvertisementToSign(config, parsed->neighbours[1])).value());
    peer.set_certificate(signer.certificate());
    ExpectRefused(keys, because);
  }
}


// The consistency check over real signatures: sites 0, 1, 2 run the round
// through a SecAggServer up to the unmasking request, each signing the
// survivor set it is told with its certificate's key. A site reveals its
// shares only with valid signatures over the set it signed from t = 2 of its
// neighbours, each under the certificate that signed that neighbour's keys.
class SecAggSiteConsistency : public SecAggSiteKeys {
 protected:
  static constexpr uint64_t kRound = 4;

  // Keys as an honest server relays them to `to`.
  v1::SecAggKeys RelayedTo(uint32_t to) const {
    v1::SecAggKeys keys;
    keys.set_round(kRound);
    for (uint32_t u = 0; u < 3; ++u) {
      if (u == to) continue;
      v1::SecAggPeerKeys& peer = *keys.add_neighbours();
      peer.set_site(u);
      peer.set_mask_public_key(adverts_[u].mask_public_key());
      peer.set_share_public_key(adverts_[u].share_public_key());
      peer.set_signature(adverts_[u].signature());
      peer.set_certificate(adverts_[u].certificate());
    }
    return keys;
  }

  // Through the masked inputs: `survivors_` is U3 = {0, 1, 2}.
  void DriveToConsistency() {
    StartRound(kRound);
    auto server = secagg::SecAggServer::Create(Config(kRound));
    ASSERT_TRUE(server.ok());
    server_.emplace(std::move(*server));
    for (uint32_t u = 0; u < 3; ++u) {
      auto keys = secagg::FromProto(adverts_[u], u);
      ASSERT_TRUE(keys.ok());
      ASSERT_TRUE(server_->Receive(*keys).ok());
    }
    ASSERT_TRUE(server_->CloseAdvertise().ok());
    for (uint32_t u = 0; u < 3; ++u) {
      auto shares = sites_[u]->OnKeys(RelayedTo(u));
      ASSERT_TRUE(shares.ok()) << shares.status().ToString();
      auto parsed = secagg::FromProto(shares->secagg_shares(), u);
      ASSERT_TRUE(parsed.ok());
      ASSERT_TRUE(server_->Receive(*parsed).ok());
    }
    auto inboxes = server_->CloseShareKeys();
    ASSERT_TRUE(inboxes.ok());
    for (uint32_t u = 0; u < 3; ++u) {
      ASSERT_TRUE(sites_[u]->OnInbox(secagg::ToProto(inboxes->at(u), kRound)).ok());
      const std::vector<float> update(kDimension, 0.01f * float(u + 1));
      auto frames = sites_[u]->MaskedInput(update, kDimension, 10, 0.5, 0.1, {});
      ASSERT_TRUE(frames.ok()) << frames.status().ToString();
      std::vector<uint32_t> values;
      ASSERT_TRUE(secagg::AppendMaskedChunk((*frames)[1].secagg_masked_chunk(), kDimension, values).ok());
      ASSERT_TRUE(server_->Receive(secagg::MaskedInput{u, values}).ok());
    }
    auto survivors = server_->CloseMaskedInput();
    ASSERT_TRUE(survivors.ok());
    survivors_ = *survivors;
  }
  // Site u signs `told`: its signature.
  std::string Sign(uint32_t u, const secagg::SurvivorSet& told) {
    auto signed_survivors = sites_[u]->OnSurvivors(secagg::ToProto(told, kRound, 3));
    EXPECT_TRUE(signed_survivors.ok()) << signed_survivors.status().ToString();
    return signed_survivors.ok() ? signed_survivors->secagg_survivors_signed().signature() : std::string();
  }
  // An unmasking request with these signatures: it names no set, the site
  // unmasks by the one it signed.
  static v1::SecAggUnmask Request(const std::map<uint32_t, std::string>& signatures) {
    secagg::UnmaskRequest request;
    for (const auto& [v, signature] : signatures) request.signatures.push_back({v, signature});
    return secagg::ToProto(request, kRound);
  }
  void ExpectUnmaskRefused(uint32_t u, const v1::SecAggUnmask& request, const std::string& because) {
    auto response = sites_[u]->OnUnmask(request);
    ASSERT_FALSE(response.ok()) << "site " << u << " revealed its shares";
    EXPECT_NE(response.status().message().find(because), std::string::npos) << response.status().message();
    EXPECT_EQ(response.status().message().find('\n'), std::string::npos);
  }

  std::optional<secagg::SecAggServer> server_;
  secagg::SurvivorSet survivors_;
};

TEST_F(SecAggSiteConsistency, TheSameSetSignedByItsNeighboursIsAnsweredAndTheSumUnmasked) {
  DriveToConsistency();
  for (uint32_t u = 0; u < 3; ++u) {
    ASSERT_TRUE(server_->Receive(secagg::SurvivorsSigned{u, Sign(u, survivors_)}).ok());
  }
  auto requests = server_->CloseConsistency();
  ASSERT_TRUE(requests.ok());
  for (uint32_t u = 0; u < 3; ++u) {
    EXPECT_EQ(requests->at(u).signatures.size(), 2u);
    auto response = sites_[u]->OnUnmask(secagg::ToProto(requests->at(u), kRound));
    ASSERT_TRUE(response.ok()) << response.status().ToString();
    auto parsed = secagg::FromProto(response->secagg_unmask_response(), u);
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(parsed->seed_shares.size(), 2u);
    ASSERT_TRUE(server_->Receive(*parsed).ok());
  }
  auto output = server_->Finish();
  ASSERT_TRUE(output.ok()) << output.status().ToString();
  EXPECT_EQ(output->included, (std::vector<uint32_t>{0, 1, 2}));
}

TEST_F(SecAggSiteConsistency, TwoSitesToldDifferentSurvivorSetsBothRefuse) {
  DriveToConsistency();
  // Site 2 is told that site 1 dropped (to have it reveal sk_1); 0 and 1 the truth.
  const secagg::SurvivorSet lie{.survived = {0, 2}};
  const std::string by0 = Sign(0, survivors_), by1 = Sign(1, survivors_), by2 = Sign(2, lie);
  ExpectUnmaskRefused(0, Request({{1, by1}, {2, by2}}),
                      "site 2's signature on the survivor set refused: crypto: the signature of 'site-c' does not "
                      "verify");
  ExpectUnmaskRefused(2, Request({{0, by0}, {1, by1}}),
                      "site 0's signature on the survivor set refused: crypto: the signature of 'site-a' does not "
                      "verify");
  // Site 1, with its one honest neighbour's signature alone: one of t = 2.
  ExpectUnmaskRefused(1, Request({{0, by0}}),
                      "1 of its neighbours signed the survivor set, fewer than the threshold 2: refusing to reveal");
}

// U3 arrives as a bitmap over the 3 ids (1 byte); one of another length, or
// with a bit past the sites, is refused with one line, and nothing is signed.
TEST_F(SecAggSiteConsistency, ABitmapOfTheWrongLengthOrWithABitPastTheSitesIsRefused) {
  DriveToConsistency();
  v1::SecAggSurvivors told = secagg::ToProto(survivors_, kRound, 3);
  EXPECT_EQ(told.survived_bitmap(), std::string(1, char(0x07)));
  v1::SecAggSurvivors longer = told;
  longer.mutable_survived_bitmap()->push_back('\0');
  auto refused = sites_[0]->OnSurvivors(longer);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().message(), "secagg site 0: round 4: consistency check: secagg: survivors "
                                        "survived_bitmap: 2 bytes, expected 1 for 3 sites");
  v1::SecAggSurvivors past = told;
  past.set_survived_bitmap(std::string(1, char(0x0f)));  // site 3 of 3
  refused = sites_[1]->OnSurvivors(past);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().message(), "secagg site 1: round 4: consistency check: secagg: survivors "
                                        "survived_bitmap: bit 3 is set, past the 3 sites");
  // Without itself: the site refuses to sign.
  v1::SecAggSurvivors without_2 = told;
  without_2.set_survived_bitmap(std::string(1, char(0x03)));
  refused = sites_[2]->OnSurvivors(without_2);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().message(), "secagg site 2: round 4: consistency check: this site sent its masked input "
                                        "but is not listed as survived");
}

TEST_F(SecAggSiteConsistency, ForgedUnsignedOtherRoundAndOtherCertificateSignaturesAreRefused) {
  DriveToConsistency();
  const std::string by1 = Sign(1, survivors_), by2 = Sign(2, survivors_);
  (void)Sign(0, survivors_);
  // Each refusal ends the site's part, so each case needs a fresh round.
  std::string forged = by2;
  forged[forged.size() / 2] ^= 0x01;
  ExpectUnmaskRefused(0, Request({{1, by1}, {2, forged}}),
                      "site 2's signature on the survivor set refused: crypto: the signature of 'site-c' does not "
                      "verify");

  DriveToConsistency();
  const std::string fresh1 = Sign(1, survivors_);
  (void)Sign(0, survivors_);
  ExpectUnmaskRefused(0, Request({{1, fresh1}, {2, ""}}),
                      "unmask request signature: site 2's signature has 0 bytes");

  DriveToConsistency();
  const std::string again1 = Sign(1, survivors_);
  (void)Sign(0, survivors_);
  // Site-c's key, over last round's set of the same sites.
  secagg::ProtocolConfig last = Config(kRound - 1);
  last.graph_seed = Config(kRound).graph_seed;
  auto stale = identities_[2].signer.Sign(secagg::SurvivorsToSign(last, survivors_.survived));
  ASSERT_TRUE(stale.ok());
  ExpectUnmaskRefused(0, Request({{1, again1}, {2, *stale}}),
                      "site 2's signature on the survivor set refused: crypto: the signature of 'site-c' does not "
                      "verify");

  DriveToConsistency();
  const std::string last1 = Sign(1, survivors_);
  (void)Sign(0, survivors_);
  // The right bytes, signed by a certificate of the federation that is not site 2's (the server's pick).
  auto other = identities_[3].signer.Sign(secagg::SurvivorsToSign(Config(kRound), survivors_.survived));
  ASSERT_TRUE(other.ok());
  ExpectUnmaskRefused(0, Request({{1, last1}, {2, *other}}),
                      "site 2's signature on the survivor set refused: crypto: the signature of 'site-c' does not "
                      "verify");
}


// A lora site's movement, what the protocol sums for it: its upload less the
// global model's tensors of the same names, wherever the global holds them.
TEST(SecAggLora, TheMovementIsTheUploadLessTheGlobalTensorsOfTheSameNames) {
  Manifest global;
  global.Append("base.weight", {3});
  global.Append("m.lora_A.weight", {2});
  global.Append("m.lora_B.weight", {2});
  const std::vector<float> global_values = {9, 9, 9, 1, 2, 3, 4};
  Manifest upload;  // frozen-a: B alone, from offset 0
  upload.Append("m.lora_B.weight", {2});
  std::vector<float> values = {3.5f, 5};
  ASSERT_TRUE(SubtractGlobalTensors(upload, global, global_values, values).ok());
  EXPECT_EQ(values, (std::vector<float>{0.5f, 1}));
  Manifest stranger;
  stranger.Append("m.lora_C.weight", {2});
  EXPECT_EQ(SubtractGlobalTensors(stranger, global, global_values, values).message(),
            "lora upload tensor m.lora_C.weight: not in the global model");
  Manifest wider;
  wider.Append("m.lora_A.weight", {3});
  std::vector<float> three(3);
  EXPECT_EQ(SubtractGlobalTensors(wider, global, global_values, three).message(),
            "lora upload tensor m.lora_A.weight: of another size in the global model");
}

// A site takes a lora round only under a merge that needs sums of factors.
TEST_F(SecAggSiteKeys, ALoraRoundIsTakenUnderNaiveAndFrozenAButNotExact) {
  for (const char* merge : {"naive", "frozen-a", "exact"}) {
    v1::RoundStart start = Start(4, 0);
    start.mutable_task()->set_update_kind(v1::UPDATE_LORA);
    start.mutable_task()->mutable_lora()->set_merge(merge);
    start.mutable_manifest()->set_total_elements(kDimension + 100);  // the upload is part of the model
    v1::Envelope advertise;
    auto site = SecAggSite::Start(start, identities_[0], &advertise);
    if (std::string_view(merge) == "exact") {
      ASSERT_FALSE(site.ok());
      EXPECT_EQ(site.status().message(), "secagg: a lora round merged 'exact': secure aggregation gives only sums of "
                                         "factors (naive, frozen-a)");
    } else {
      EXPECT_TRUE(site.ok()) << merge << ": " << site.status().ToString();
    }
  }
}

}  // namespace
}  // namespace estuary::client
