#include "secagg/wire.h"

#include <gtest/gtest.h>

#include "secagg/client.h"

namespace estuary::secagg {
namespace {

Key32 Filled(uint8_t v) {
  Key32 k;
  k.fill(v);
  return k;
}

TEST(Wire, TheSetupRoundTripsAndABadOneIsRefused) {
  ProtocolConfig config = DefaultProtocolConfig(10, 1000, 7, Filled(3));
  const v1::SecAggSetup setup = ToProto(config, 4, 100, 894, 300);
  auto back = ConfigFromProto(setup, 7);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->sites, 10u);
  EXPECT_EQ(back->degree, config.degree);
  EXPECT_EQ(back->threshold, config.threshold);
  EXPECT_EQ(back->graph_seed, config.graph_seed);
  EXPECT_EQ(back->dimension, 1000u);
  EXPECT_EQ(setup.weight(), 300u);

  v1::SecAggSetup bad = setup;
  bad.set_graph_seed("short");
  EXPECT_EQ(ConfigFromProto(bad, 7).status().message(), "secagg: setup graph_seed: 5 bytes, expected 32");
  bad = setup;
  bad.set_site(10);
  EXPECT_EQ(ConfigFromProto(bad, 7).status().message(), "secagg: setup: site 10 of 10 sites");
  bad = setup;
  bad.set_threshold(2);  // not a majority of k = 9
  EXPECT_FALSE(ConfigFromProto(bad, 7).ok());
}

TEST(Wire, EveryStageMessageRoundTripsThroughTheStateMachines) {
  ProtocolConfig config = DefaultProtocolConfig(3, 5, 1, Filled(9));
  auto a = SecAggClient::Create(config, 0), b = SecAggClient::Create(config, 1);
  ASSERT_TRUE(a.ok() && b.ok());
  auto keys_a = a->Advertise(), keys_b = b->Advertise();
  ASSERT_TRUE(keys_a.ok() && keys_b.ok());
  auto wire_keys = FromProto(ToProto(*keys_a, 1), 0);
  ASSERT_TRUE(wire_keys.ok());
  EXPECT_EQ(wire_keys->mask_public_key, keys_a->mask_public_key);
  EXPECT_EQ(wire_keys->share_public_key, keys_a->share_public_key);

  auto broadcast = FromProto(ToProto(KeysBroadcast{.neighbours = {*keys_b}}, 1));
  ASSERT_TRUE(broadcast.ok());
  ASSERT_EQ(broadcast->neighbours.size(), 1u);
  EXPECT_EQ(broadcast->neighbours[0].site, 1u);
  EXPECT_EQ(broadcast->neighbours[0].mask_public_key, keys_b->mask_public_key);

  // t = 2 of k = 2: a site with one advertised neighbour refuses, as it should.
  EXPECT_FALSE(a->Share(*broadcast).ok());

  ShareKeys shares{.site = 2, .seed_commitment = Filled(1), .key_commitment = Filled(2),
                   .envelopes = {{.peer = 0, .envelope = std::vector<uint8_t>(kShareEnvelopeBytes, 7)}}};
  auto wire_shares = FromProto(ToProto(shares, 1), 2);
  ASSERT_TRUE(wire_shares.ok());
  EXPECT_EQ(wire_shares->seed_commitment, shares.seed_commitment);
  EXPECT_EQ(wire_shares->envelopes[0].envelope, shares.envelopes[0].envelope);
  v1::SecAggShares short_envelope = ToProto(shares, 1);
  short_envelope.mutable_envelopes(0)->mutable_envelope()->pop_back();
  EXPECT_EQ(FromProto(short_envelope, 2).status().message(),
            "secagg: shares: the envelope for site 0 has 159 bytes, expected 160");
  v1::SecAggInbox inbox = ToProto(ShareInbox{.envelopes = shares.envelopes}, 1);
  EXPECT_TRUE(FromProto(inbox).ok());
  inbox.mutable_envelopes(0)->mutable_envelope()->append("x");
  EXPECT_EQ(FromProto(inbox).status().message(), "secagg: inbox: the envelope for site 0 has 161 bytes, expected 160");

  const SurvivorSet survivors{.survived = {0, 2}};
  auto survivors_back = FromProto(ToProto(survivors, 1, 3), 3);
  ASSERT_TRUE(survivors_back.ok());
  EXPECT_EQ(survivors_back->survived, survivors.survived);
  const SurvivorsSigned signed_survivors{.site = 2, .signature = "a signature"};
  auto signed_back = FromProto(ToProto(signed_survivors, 1), 2);
  ASSERT_TRUE(signed_back.ok());
  EXPECT_EQ(signed_back->signature, signed_survivors.signature);
  EXPECT_EQ(FromProto(ToProto(SurvivorsSigned{.site = 2}, 1), 2).status().message(),
            "secagg: signed survivor set: site 2's signature has 0 bytes, expected 1 to 1024");

  const UnmaskRequest request{.signatures = {{2, "signed by 2"}}};
  auto request_back = FromProto(ToProto(request, 1));
  ASSERT_TRUE(request_back.ok());
  ASSERT_EQ(request_back->signatures.size(), 1u);
  EXPECT_EQ(request_back->signatures[0].site, 2u);
  EXPECT_EQ(request_back->signatures[0].signature, "signed by 2");
  v1::SecAggUnmask unsigned_request = ToProto(request, 1);
  unsigned_request.mutable_signatures(0)->clear_signature();
  EXPECT_EQ(FromProto(unsigned_request).status().message(),
            "secagg: unmask request signature: site 2's signature has 0 bytes, expected 1 to 1024");
  unsigned_request.mutable_signatures(0)->set_signature(std::string(1025, 'x'));
  EXPECT_FALSE(FromProto(unsigned_request).ok());

  UnmaskResponse response{.site = 1};
  response.seed_shares.push_back({.peer = 0});
  response.seed_shares[0].y.fill(5);
  response.key_shares.push_back({.peer = 2});
  auto response_back = FromProto(ToProto(response, 1), 1);
  ASSERT_TRUE(response_back.ok());
  EXPECT_EQ(response_back->seed_shares[0].y, response.seed_shares[0].y);
  EXPECT_EQ(response_back->key_shares[0].peer, 2u);
  v1::SecAggUnmaskResponse wrong = ToProto(response, 1);
  wrong.mutable_key_shares(0)->set_y("tiny");
  EXPECT_EQ(FromProto(wrong, 1).status().message(), "secagg: unmask response key share: 4 bytes, expected 66");
}

TEST(Wire, TheSurvivorSetTravelsAsOneBitASiteAndABadBitmapIsRefused) {
  // 1,000 sites: 125 bytes, where a list of ids took 4 a survivor.
  SurvivorSet many;
  for (uint32_t u = 1; u < 1000; u += 3) many.survived.push_back(u);  // 1, 4, ..., 997
  many.survived.push_back(999);  // the last id, in the last byte
  const v1::SecAggSurvivors wire = ToProto(many, 7, 1000);
  EXPECT_EQ(wire.round(), 7u);
  EXPECT_EQ(wire.survived_bitmap().size(), 125u);
  EXPECT_EQ(SurvivorBitmapBytes(1000), 125u);
  EXPECT_EQ(WireBytes(many, 1000), 4u + 125u);
  auto back = FromProto(wire, 1000);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->survived, many.survived);  // ascending, as signed
  // Site u is bit u % 8 of byte u / 8, least significant first.
  EXPECT_EQ(uint8_t(ToProto(SurvivorSet{.survived = {0, 9}}, 1, 10).survived_bitmap()[1]), 0x02);

  EXPECT_EQ(FromProto(wire, 1001).status().message(),
            "secagg: survivors survived_bitmap: 125 bytes, expected 126 for 1001 sites");
  v1::SecAggSurvivors longer = wire;
  longer.mutable_survived_bitmap()->push_back('\0');
  EXPECT_EQ(FromProto(longer, 1000).status().message(),
            "secagg: survivors survived_bitmap: 126 bytes, expected 125 for 1000 sites");
  v1::SecAggSurvivors past = ToProto(SurvivorSet{.survived = {0, 1}}, 1, 10);  // 2 bytes: bits 10..15 unused
  (*past.mutable_survived_bitmap())[1] = char(0x04);
  EXPECT_EQ(FromProto(past, 10).status().message(),
            "secagg: survivors survived_bitmap: bit 10 is set, past the 10 sites");
  EXPECT_EQ(FromProto(v1::SecAggSurvivors(), 10).status().message(),
            "secagg: survivors survived_bitmap: 0 bytes, expected 2 for 10 sites");
}

TEST(Wire, MaskedChunksArriveInOrderAsWholeLittleEndianElements) {
  const std::vector<uint32_t> values = {0x01020304u, 0xffffffffu, 0, 42, 0x80000000u};
  std::vector<uint32_t> out;
  v1::Envelope first = MaskedChunkMessage(3, 0, std::span(values).subspan(0, 2));
  EXPECT_EQ(first.secagg_masked_chunk().data().substr(0, 4), std::string("\x04\x03\x02\x01", 4));
  ASSERT_TRUE(AppendMaskedChunk(first.secagg_masked_chunk(), 5, out).ok());
  v1::Envelope again = first;  // a repeat: not where the input continues
  EXPECT_EQ(AppendMaskedChunk(again.secagg_masked_chunk(), 5, out).message(),
            "secagg: masked input chunk at element 0, expected 2");
  v1::Envelope rest = MaskedChunkMessage(3, 2, std::span(values).subspan(2));
  v1::Envelope ragged = rest;
  ragged.mutable_secagg_masked_chunk()->mutable_data()->pop_back();
  EXPECT_FALSE(AppendMaskedChunk(ragged.secagg_masked_chunk(), 5, out).ok());
  EXPECT_EQ(out.size(), 2u);  // a refused chunk adds nothing
  EXPECT_FALSE(AppendMaskedChunk(rest.secagg_masked_chunk(), 4, out).ok());  // past the dimension
  ASSERT_TRUE(AppendMaskedChunk(rest.secagg_masked_chunk(), 5, out).ok());
  EXPECT_EQ(out, values);
}

}  // namespace
}  // namespace estuary::secagg
