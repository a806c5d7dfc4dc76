#include "secagg/wire.h"

#include <cstring>
#include <string>

namespace estuary::secagg {
namespace {

template <size_t N>
std::string Bytes(const std::array<uint8_t, N>& value) {
  return std::string(reinterpret_cast<const char*>(value.data()), N);
}

template <size_t N>
Status Fixed(const std::string& bytes, const char* field, std::array<uint8_t, N>* out) {
  if (bytes.size() != N) return InvalidArgument("secagg: {}: {} bytes, expected {}", field, bytes.size(), N);
  std::memcpy(out->data(), bytes.data(), N);
  return Status::Ok();
}

template <typename Repeated>
Result<std::vector<SealedShare>> Envelopes(const Repeated& repeated, const char* message) {
  std::vector<SealedShare> out;
  out.reserve(repeated.size());
  for (const v1::SecAggSealedShare& sealed : repeated) {
    if (sealed.envelope().size() != kShareEnvelopeBytes) {
      return InvalidArgument("secagg: {}: the envelope for site {} has {} bytes, expected {}", message, sealed.peer(),
                             sealed.envelope().size(), kShareEnvelopeBytes);
    }
    out.push_back({sealed.peer(), std::vector<uint8_t>(sealed.envelope().begin(), sealed.envelope().end())});
  }
  return out;
}

template <typename Repeated>
Result<std::vector<PeerShare>> Shares(const Repeated& repeated, const char* field) {
  std::vector<PeerShare> out(repeated.size());
  for (int i = 0; i < repeated.size(); ++i) {
    out[i].peer = repeated[i].peer();
    ESTUARY_RETURN_IF_ERROR(Fixed(repeated[i].y(), field, &out[i].y));
  }
  return out;
}

Status SignatureSize(const std::string& signature, const char* field, uint32_t site) {
  if (!signature.empty() && signature.size() <= kMaxSurvivorSignatureBytes) return Status::Ok();
  return InvalidArgument("secagg: {}: site {}'s signature has {} bytes, expected 1 to {}", field, site,
                         signature.size(), kMaxSurvivorSignatureBytes);
}

}  // namespace

v1::SecAggSetup ToProto(const ProtocolConfig& config, uint32_t site, double clip, double scale, uint64_t weight) {
  v1::SecAggSetup out;
  out.set_site(site);
  out.set_sites(config.sites);
  out.set_neighbours(uint32_t(config.degree));
  out.set_threshold(uint32_t(config.threshold));
  out.set_bits(uint32_t(config.bits));
  out.set_clip(clip);
  out.set_scale(scale);
  out.set_weight(weight);
  out.set_graph_seed(Bytes(config.graph_seed));
  out.set_dimension(config.dimension);
  return out;
}

Result<ProtocolConfig> ConfigFromProto(const v1::SecAggSetup& setup, uint64_t round) {
  ProtocolConfig config{.round = round,
                        .sites = setup.sites(),
                        .degree = int(std::min<uint32_t>(setup.neighbours(), 1u << 30)),
                        .threshold = int(std::min<uint32_t>(setup.threshold(), 1u << 30)),
                        .bits = int(std::min<uint32_t>(setup.bits(), 64)),
                        .dimension = setup.dimension()};
  ESTUARY_RETURN_IF_ERROR(Fixed(setup.graph_seed(), "setup graph_seed", &config.graph_seed));
  if (Status ok = CheckProtocolConfig(config); !ok.ok()) return InvalidArgument("secagg: setup: {}", ok.message());
  if (setup.site() >= setup.sites()) {
    return InvalidArgument("secagg: setup: site {} of {} sites", setup.site(), setup.sites());
  }
  return config;
}

std::string AdvertisementToSign(const ProtocolConfig& config, const AdvertiseKeys& keys) {
  std::string out("estuary secagg advertise v2");
  out.push_back('\0');
  auto little_endian = [&out](uint64_t value, int bytes) {
    for (int i = 0; i < bytes; ++i) out.push_back(char(value >> (8 * i)));
  };
  little_endian(config.round, 8);
  little_endian(config.sites, 4);
  out += Bytes(config.graph_seed);
  little_endian(keys.site, 4);
  out += Bytes(keys.mask_public_key);
  out += Bytes(keys.share_public_key);
  return out;
}

v1::SecAggAdvertise ToProto(const AdvertiseKeys& message, uint64_t round) {
  v1::SecAggAdvertise out;
  out.set_round(round);
  out.set_mask_public_key(Bytes(message.mask_public_key));
  out.set_share_public_key(Bytes(message.share_public_key));
  return out;
}

Result<AdvertiseKeys> FromProto(const v1::SecAggAdvertise& message, uint32_t site) {
  AdvertiseKeys out{.site = site};
  ESTUARY_RETURN_IF_ERROR(Fixed(message.mask_public_key(), "advertise mask_public_key", &out.mask_public_key));
  ESTUARY_RETURN_IF_ERROR(Fixed(message.share_public_key(), "advertise share_public_key", &out.share_public_key));
  return out;
}

v1::SecAggKeys ToProto(const KeysBroadcast& message, uint64_t round) {
  v1::SecAggKeys out;
  out.set_round(round);
  for (const AdvertiseKeys& keys : message.neighbours) {
    auto* peer = out.add_neighbours();
    peer->set_site(keys.site);
    peer->set_mask_public_key(Bytes(keys.mask_public_key));
    peer->set_share_public_key(Bytes(keys.share_public_key));
  }
  return out;
}

Result<KeysBroadcast> FromProto(const v1::SecAggKeys& message) {
  KeysBroadcast out;
  for (const v1::SecAggPeerKeys& peer : message.neighbours()) {
    AdvertiseKeys keys{.site = peer.site()};
    ESTUARY_RETURN_IF_ERROR(Fixed(peer.mask_public_key(), "keys mask_public_key", &keys.mask_public_key));
    ESTUARY_RETURN_IF_ERROR(Fixed(peer.share_public_key(), "keys share_public_key", &keys.share_public_key));
    out.neighbours.push_back(keys);
  }
  return out;
}

v1::SecAggShares ToProto(const ShareKeys& message, uint64_t round) {
  v1::SecAggShares out;
  out.set_round(round);
  out.set_seed_commitment(Bytes(message.seed_commitment));
  out.set_key_commitment(Bytes(message.key_commitment));
  for (const SealedShare& sealed : message.envelopes) {
    auto* e = out.add_envelopes();
    e->set_peer(sealed.peer);
    e->set_envelope(std::string(sealed.envelope.begin(), sealed.envelope.end()));
  }
  return out;
}

Result<ShareKeys> FromProto(const v1::SecAggShares& message, uint32_t site) {
  ShareKeys out{.site = site};
  ESTUARY_RETURN_IF_ERROR(Fixed(message.seed_commitment(), "shares seed_commitment", &out.seed_commitment));
  ESTUARY_RETURN_IF_ERROR(Fixed(message.key_commitment(), "shares key_commitment", &out.key_commitment));
  ESTUARY_ASSIGN_OR_RETURN(out.envelopes, Envelopes(message.envelopes(), "shares"));
  return out;
}

v1::SecAggInbox ToProto(const ShareInbox& message, uint64_t round) {
  v1::SecAggInbox out;
  out.set_round(round);
  for (const SealedShare& sealed : message.envelopes) {
    auto* e = out.add_envelopes();
    e->set_peer(sealed.peer);
    e->set_envelope(std::string(sealed.envelope.begin(), sealed.envelope.end()));
  }
  return out;
}

Result<ShareInbox> FromProto(const v1::SecAggInbox& message) {
  ShareInbox out;
  ESTUARY_ASSIGN_OR_RETURN(out.envelopes, Envelopes(message.envelopes(), "inbox"));
  return out;
}

v1::SecAggSurvivors ToProto(const SurvivorSet& message, uint64_t round, uint32_t sites) {
  v1::SecAggSurvivors out;
  out.set_round(round);
  std::string bitmap(SurvivorBitmapBytes(sites), '\0');
  for (uint32_t u : message.survived) {
    if (u < sites) bitmap[u / 8] = char(uint8_t(bitmap[u / 8]) | (1u << (u % 8)));
  }
  out.set_survived_bitmap(std::move(bitmap));
  return out;
}

Result<SurvivorSet> FromProto(const v1::SecAggSurvivors& message, uint32_t sites) {
  const std::string& bitmap = message.survived_bitmap();
  if (bitmap.size() != SurvivorBitmapBytes(sites)) {
    return InvalidArgument("secagg: survivors survived_bitmap: {} bytes, expected {} for {} sites", bitmap.size(),
                           SurvivorBitmapBytes(sites), sites);
  }
  SurvivorSet out;
  for (size_t byte = 0; byte < bitmap.size(); ++byte) {
    const uint8_t bits = uint8_t(bitmap[byte]);
    for (uint32_t bit = 0; bits >> bit != 0; ++bit) {
      if ((bits >> bit & 1u) == 0) continue;
      const uint64_t u = 8 * uint64_t(byte) + bit;
      if (u >= sites) {
        return InvalidArgument("secagg: survivors survived_bitmap: bit {} is set, past the {} sites", u, sites);
      }
      out.survived.push_back(uint32_t(u));
    }
  }
  return out;
}

v1::SecAggSurvivorsSigned ToProto(const SurvivorsSigned& message, uint64_t round) {
  v1::SecAggSurvivorsSigned out;
  out.set_round(round);
  out.set_signature(message.signature);
  return out;
}

Result<SurvivorsSigned> FromProto(const v1::SecAggSurvivorsSigned& message, uint32_t site) {
  ESTUARY_RETURN_IF_ERROR(SignatureSize(message.signature(), "signed survivor set", site));
  return SurvivorsSigned{.site = site, .signature = message.signature()};
}

v1::SecAggUnmask ToProto(const UnmaskRequest& message, uint64_t round) {
  v1::SecAggUnmask out;
  out.set_round(round);
  for (const SurvivorsSigned& signature : message.signatures) {
    auto* s = out.add_signatures();
    s->set_site(signature.site);
    s->set_signature(signature.signature);
  }
  return out;
}

Result<UnmaskRequest> FromProto(const v1::SecAggUnmask& message) {
  UnmaskRequest out;
  for (const v1::SecAggSurvivorSignature& signature : message.signatures()) {
    ESTUARY_RETURN_IF_ERROR(SignatureSize(signature.signature(), "unmask request signature", signature.site()));
    out.signatures.push_back({signature.site(), signature.signature()});
  }
  return out;
}

v1::SecAggUnmaskResponse ToProto(const UnmaskResponse& message, uint64_t round) {
  v1::SecAggUnmaskResponse out;
  out.set_round(round);
  for (const PeerShare& share : message.seed_shares) {
    auto* s = out.add_seed_shares();
    s->set_peer(share.peer);
    s->set_y(Bytes(share.y));
  }
  for (const PeerShare& share : message.key_shares) {
    auto* s = out.add_key_shares();
    s->set_peer(share.peer);
    s->set_y(Bytes(share.y));
  }
  return out;
}

Result<UnmaskResponse> FromProto(const v1::SecAggUnmaskResponse& message, uint32_t site) {
  UnmaskResponse out{.site = site};
  ESTUARY_ASSIGN_OR_RETURN(out.seed_shares, Shares(message.seed_shares(), "unmask response seed share"));
  ESTUARY_ASSIGN_OR_RETURN(out.key_shares, Shares(message.key_shares(), "unmask response key share"));
  return out;
}

Status DecodeMaskedChunk(const v1::SecAggMaskedChunk& chunk, uint64_t expected_offset, uint64_t dimension,
                         std::vector<uint32_t>& out) {
  const std::string& data = chunk.data();
  if (chunk.offset() != expected_offset) {
    return InvalidArgument("secagg: masked input chunk at element {}, expected {}", chunk.offset(), expected_offset);
  }
  if (data.empty() || data.size() % 4 != 0 || expected_offset > dimension ||
      data.size() / 4 > dimension - expected_offset) {
    return InvalidArgument("secagg: masked input chunk of {} bytes at element {}: not whole elements within the {} "
                           "of the input",
                           data.size(), chunk.offset(), dimension);
  }
  const size_t count = data.size() / 4;
  out.resize(count);
  const auto* bytes = reinterpret_cast<const uint8_t*>(data.data());
  for (size_t i = 0; i < count; ++i) {
    out[i] = uint32_t(bytes[4 * i]) | uint32_t(bytes[4 * i + 1]) << 8 | uint32_t(bytes[4 * i + 2]) << 16 |
             uint32_t(bytes[4 * i + 3]) << 24;
  }
  return Status::Ok();
}

Status AppendMaskedChunk(const v1::SecAggMaskedChunk& chunk, uint64_t dimension, std::vector<uint32_t>& out) {
  std::vector<uint32_t> values;
  ESTUARY_RETURN_IF_ERROR(DecodeMaskedChunk(chunk, out.size(), dimension, values));
  out.insert(out.end(), values.begin(), values.end());
  return Status::Ok();
}

v1::Envelope MaskedBeginMessage(uint64_t round) {
  v1::Envelope envelope;
  envelope.mutable_secagg_masked_chunk()->set_round(round);
  envelope.mutable_secagg_masked_chunk()->set_offset(0);
  return envelope;
}

bool IsMaskedBegin(const v1::SecAggMaskedChunk& chunk) { return chunk.offset() == 0 && chunk.data().empty(); }

v1::Envelope MaskedChunkMessage(uint64_t round, uint64_t offset, std::span<const uint32_t> values) {
  v1::Envelope envelope;
  auto* chunk = envelope.mutable_secagg_masked_chunk();
  chunk->set_round(round);
  chunk->set_offset(offset);
  std::string data(values.size() * 4, '\0');
  for (size_t i = 0; i < values.size(); ++i) {
    for (int b = 0; b < 4; ++b) data[4 * i + b] = char(uint8_t(values[i] >> (8 * b)));
  }
  chunk->set_data(std::move(data));
  return envelope;
}

}  // namespace estuary::secagg
