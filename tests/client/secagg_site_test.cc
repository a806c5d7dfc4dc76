// A site's checks of the keys the server relays to it in SecAgg+
// (client/secagg_site.h): it takes its neighbours' keys only signed, over
// this round's setup and the neighbour's id, by distinct site certificates of
// the federation other than its own. A server that substitutes a key (the
// attack that would let it open the shares sealed to it), replays last
// round's, relays keys unsigned, or signs two neighbours' with one
// certificate is refused in one line before the site shares anything.
#include "client/secagg_site.h"

#include <gtest/gtest.h>

#include "crypto/certs.h"
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

}  // namespace
}  // namespace estuary::client
