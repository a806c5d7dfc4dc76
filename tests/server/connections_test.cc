// Connections: revocation and the Hello's checks, in front of a Coordinator
// with fake sites.
#include <gtest/gtest.h>

#include "proto/frame.h"
#include "server/connections.h"
#include "server/event_throttle.h"
#include "tests/server/fakes.h"

namespace estuary::server {
namespace {

using fake::CoordinatorRig;
using fake::FakeSession;

crypto::CrlInfo Revoking(std::vector<std::string> serials) {
  crypto::CrlInfo crl;
  for (auto& serial : serials) {
    crypto::RevokedCertificate revoked;
    revoked.serial = std::move(serial);
    crl.revoked.push_back(std::move(revoked));
  }
  return crl;
}

class ConnectionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    rig.config.min_clients = 10;  // no round: these clients only connect
    ASSERT_TRUE(rig.Start().ok());
    connections = std::make_unique<Connections>(*rig.coordinator, *rig.store, rig.clock);
  }

  std::shared_ptr<FakeSession> Hello(const std::string& name, const std::string& serial,
                                     uint32_t version = proto::kProtocolVersion) {
    auto session = std::make_shared<FakeSession>(name, serial);
    session->on_closed = [this](ClientSession& closed) { connections->OnClosed(closed); };
    v1::Hello hello;
    hello.set_protocol_version(version);
    connections->OnHello(session, hello);
    return session;
  }

  std::vector<std::string> ConnectedNames() {
    std::vector<std::string> names;
    for (const auto& session : rig.coordinator->Connected()) names.push_back(session->name());
    return names;
  }

  std::vector<Event> EventsOf(const std::string& kind) {
    std::vector<Event> of;
    auto events = rig.store->Events();
    EXPECT_TRUE(events.ok());
    for (const auto& e : *events) {
      if (e.kind == kind) of.push_back(e);
    }
    return of;
  }

  CoordinatorRig rig;
  std::unique_ptr<Connections> connections;
};

TEST_F(ConnectionsTest, AReloadClosesExactlyTheSessionsItRevokes) {
  auto a = Hello("site-a", "a1");
  auto b = Hello("site-b", "b2");
  auto c = Hello("site-c", "c3");
  ASSERT_EQ(ConnectedNames(), (std::vector<std::string>{"site-a", "site-b", "site-c"}));

  EXPECT_EQ(connections->Revoke(Revoking({"b2", "ff"})), std::vector<std::string>{"site-b"});
  EXPECT_EQ(b->error, v1::Error::CERTIFICATE_REVOKED);
  EXPECT_EQ(b->error_message, "certificate serial b2 is revoked by the federation");
  for (const auto& kept : {a, c}) {
    EXPECT_FALSE(kept->error) << kept->name();
    EXPECT_FALSE(kept->closing()) << kept->name();
  }
  const auto revoked = EventsOf("certificate_revoked");
  ASSERT_EQ(revoked.size(), 1u);
  EXPECT_EQ(revoked[0].peer, "site-b@127.0.0.1:site-b");
  EXPECT_EQ(revoked[0].detail, "serial b2");

  // Once its error is written the session closes, as any lost connection.
  b->Close();
  EXPECT_EQ(ConnectedNames(), (std::vector<std::string>{"site-a", "site-c"}));
}

TEST_F(ConnectionsTest, AHelloAfterTheReloadThatRevokesItsCertificateIsRefused) {
  auto a = Hello("site-a", "a1");
  EXPECT_TRUE(connections->Revoke(Revoking({"d4"})).empty());
  auto d = Hello("site-d", "d4");  // its handshake passed before the reload
  EXPECT_EQ(d->error, v1::Error::CERTIFICATE_REVOKED);
  EXPECT_TRUE(d->SentOf(v1::Envelope::kWelcome).empty());
  EXPECT_EQ(ConnectedNames(), std::vector<std::string>{"site-a"});
  ASSERT_EQ(EventsOf("certificate_revoked").size(), 1u);
  EXPECT_EQ(EventsOf("certificate_revoked")[0].peer, "site-d@127.0.0.1:site-d");
  d->Close();
  EXPECT_EQ(ConnectedNames(), std::vector<std::string>{"site-a"});

  // A later list that no longer names it lets it in.
  EXPECT_TRUE(connections->Revoke(Revoking({})).empty());
  auto again = Hello("site-d", "d4");
  EXPECT_FALSE(again->error);
  EXPECT_EQ(again->SentOf(v1::Envelope::kWelcome).size(), 1u);
  EXPECT_EQ(ConnectedNames(), (std::vector<std::string>{"site-a", "site-d"}));
}

TEST_F(ConnectionsTest, AHelloOfAnotherProtocolVersionIsRefused) {
  auto old = Hello("site-a", "a1", proto::kProtocolVersion + 1);
  EXPECT_EQ(old->error, v1::Error::BAD_MESSAGE);
  EXPECT_EQ(old->error_message, fmt::format("protocol version {} not supported (server speaks {})",
                                            proto::kProtocolVersion + 1, proto::kProtocolVersion));
  EXPECT_TRUE(ConnectedNames().empty());
}

TEST_F(ConnectionsTest, RefusedHandshakesAndBadFramesAreEvents) {
  auto a = Hello("site-a", "a1");
  connections->OnHandshakeRefused("10.0.0.9:4000", "certificate revoked");
  connections->OnBadFrame(*a, "frame of 99999999 bytes");
  const auto refused = EventsOf("handshake_refused");
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_EQ(refused[0].peer, "10.0.0.9:4000");
  EXPECT_EQ(refused[0].detail, "certificate revoked");
  const auto bad = EventsOf("frame_rejected");
  ASSERT_EQ(bad.size(), 1u);
  EXPECT_EQ(bad[0].peer, "site-a@127.0.0.1:site-a");
  EXPECT_EQ(bad[0].detail, "frame of 99999999 bytes");
}

// Before: every refused handshake was a row and a log line
// (2,400 rows/s under a replay). The first few from an address are written
// in full, the rest as one summary per interval that still counts them all.
TEST_F(ConnectionsTest, RefusedHandshakesFromOneAddressAreSummarisedPerInterval) {
  for (int i = 0; i < 200; ++i) {
    connections->OnHandshakeRefused(fmt::format("10.0.0.9:{}", 4000 + i), fmt::format("no certificate #{}", i));
  }
  connections->OnHandshakeRefused("10.0.0.7:5000", "no certificate");
  auto refused = EventsOf("handshake_refused");
  ASSERT_EQ(refused.size(), EventThrottle::kFullPerKey + 1) << "the first five from 10.0.0.9, one from 10.0.0.7";
  EXPECT_EQ(refused[0].peer, "10.0.0.9:4000");
  EXPECT_EQ(refused.back().peer, "10.0.0.7:5000");

  rig.clock.Advance(std::chrono::seconds(10));
  refused = EventsOf("handshake_refused");
  ASSERT_EQ(refused.size(), EventThrottle::kFullPerKey + 2);
  EXPECT_EQ(refused.back().peer, "10.0.0.9");
  EXPECT_EQ(refused.back().detail, "195 more in the last 10 s; the last: no certificate #199");

  // Still flooding: the next interval is one summary too, with no event in full.
  for (int i = 0; i < 50; ++i) connections->OnHandshakeRefused("10.0.0.9:6000", "again");
  EXPECT_EQ(EventsOf("handshake_refused").size(), EventThrottle::kFullPerKey + 2);
  rig.clock.Advance(std::chrono::seconds(10));
  refused = EventsOf("handshake_refused");
  ASSERT_EQ(refused.size(), EventThrottle::kFullPerKey + 3);
  EXPECT_EQ(refused.back().detail, "50 more in the last 10 s; the last: again");

  // A quiet interval forgets the address; stopping writes what is counted.
  rig.clock.Advance(std::chrono::seconds(20));
  EXPECT_EQ(rig.clock.armed(), 0u) << "nothing held: no timer";
  for (int i = 0; i < 7; ++i) connections->OnHandshakeRefused("10.0.0.9:7000", "late");
  refused = EventsOf("handshake_refused");
  EXPECT_EQ(refused.size(), 2 * EventThrottle::kFullPerKey + 3) << "five in full again";
  connections->Stop();
  refused = EventsOf("handshake_refused");
  ASSERT_EQ(refused.size(), 2 * EventThrottle::kFullPerKey + 4);
  EXPECT_EQ(refused.back().detail, "2 more in the last 0 s; the last: late");
  connections->OnHandshakeRefused("10.0.0.9:7001", "after stop");
  EXPECT_EQ(EventsOf("handshake_refused").size(), 2 * EventThrottle::kFullPerKey + 5) << "counted and written at once";
  EXPECT_EQ(rig.clock.armed(), 0u) << "a stopped server arms no timer";
}

TEST(EventThrottle, AFloodFromManyAddressesIsBoundedToo) {
  EventThrottle throttle(std::chrono::seconds(10));
  const auto now = std::chrono::steady_clock::time_point{} + std::chrono::hours(1);
  int full = 0;
  for (int host = 0; host < 1000; ++host) {
    full += throttle.Admit("handshake_refused", fmt::format("10.0.{}.{}", host / 256, host % 256), "x", now);
  }
  EXPECT_EQ(full, int(EventThrottle::kFullPerInterval)) << "at most this many in full per interval, all keys together";
  const auto summaries = throttle.Flush(now + std::chrono::seconds(10));
  uint64_t counted = 0;
  for (const auto& s : summaries) counted += s.count;
  EXPECT_EQ(counted, 900u);
  EXPECT_LE(summaries.size(), EventThrottle::kMaxKeys + 1) << "addresses beyond the cap count as one";
  EXPECT_EQ(summaries.back().host, "other addresses");
  EXPECT_EQ(HostOf("10.0.0.9:4000"), "10.0.0.9");
  EXPECT_EQ(HostOf("[::1]:4000"), "::1");
}

TEST(Connections, ARevokedSiteDropsOutOfItsRoundAsALostConnectionDoes) {
  CoordinatorRig rig;
  ASSERT_TRUE(rig.Start().ok());
  Connections connections(*rig.coordinator, *rig.store, rig.clock);
  std::vector<std::shared_ptr<FakeSession>> sites;
  for (const auto& [name, serial] : {std::pair{"site-a", "a1"}, std::pair{"site-b", "b2"}}) {
    auto session = std::make_shared<FakeSession>(name, serial);
    session->on_closed = [&](ClientSession& closed) { connections.OnClosed(closed); };
    v1::Hello hello;
    hello.set_protocol_version(proto::kProtocolVersion);
    connections.OnHello(session, hello);
    sites.push_back(session);
  }
  ASSERT_EQ(sites[1]->SentOf(v1::Envelope::kRoundStart).size(), 1u);
  connections.Revoke(Revoking({"b2"}));
  sites[1]->Close();
  auto participations = rig.store->Participations(1);
  ASSERT_TRUE(participations.ok());
  ASSERT_EQ(participations->size(), 2u);
  EXPECT_EQ((*participations)[1].client, "site-b");
  EXPECT_EQ((*participations)[1].status, "dropped");
  EXPECT_EQ((*participations)[1].detail, "connection lost");
}

}  // namespace
}  // namespace estuary::server
