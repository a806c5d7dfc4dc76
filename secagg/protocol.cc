#include "secagg/protocol.h"

#include "secagg/neighbours.h"
#include "secagg/prg.h"

namespace estuary::secagg {

ProtocolConfig DefaultProtocolConfig(uint32_t sites, uint64_t dimension, uint64_t round, const Key32& graph_seed) {
  const int degree = DefaultDegree(static_cast<int>(sites));
  return {.round = round,
          .sites = sites,
          .degree = degree,
          .threshold = DefaultThreshold(degree),
          .bits = 32,
          .dimension = dimension,
          .graph_seed = graph_seed};
}

Status CheckProtocolConfig(const ProtocolConfig& config) {
  if (config.sites < 2 || config.sites > (1u << 24)) {
    return InvalidArgument("secagg: {} sites: need 2 to 2^24", config.sites);
  }
  // The shape only: each party builds the graph (server) or its own row of it
  // (a site) once, after this.
  ESTUARY_RETURN_IF_ERROR(CheckGraphShape(int(config.sites), config.degree));
  // A strict majority: honest neighbours then cannot hand the server both
  // secrets of one site, even told different stories (docs/SECAGG.md).
  if (config.threshold <= config.degree / 2 || config.threshold > config.degree) {
    return InvalidArgument("secagg: threshold {} with {} neighbours: must be in [{}, {}] (a strict majority)",
                           config.threshold, config.degree, config.degree / 2 + 1, config.degree);
  }
  ESTUARY_RETURN_IF_ERROR(CheckRingBits(config.bits));
  if (config.dimension == 0 || config.dimension > kMaxStreamWords) {
    return InvalidArgument("secagg: dimension {}: must be in [1, 2^36]", config.dimension);
  }
  return Status::Ok();
}

std::string SurvivorsToSign(const ProtocolConfig& config, std::span<const uint32_t> survived_ascending) {
  std::string out("estuary secagg survivors v1");
  out.push_back('\0');
  auto little_endian = [&out](uint64_t value, int bytes) {
    for (int i = 0; i < bytes; ++i) out.push_back(char(value >> (8 * i)));
  };
  little_endian(config.round, 8);
  little_endian(config.sites, 4);
  out.append(reinterpret_cast<const char*>(config.graph_seed.data()), config.graph_seed.size());
  little_endian(survived_ascending.size(), 4);
  for (uint32_t u : survived_ascending) little_endian(u, 4);
  return out;
}

uint64_t WireBytes(const AdvertiseKeys&) { return 4 + 2 * 32; }

uint64_t WireBytes(const KeysBroadcast& message) { return 4 + message.neighbours.size() * (4 + 2 * 32); }

uint64_t WireBytes(const ShareKeys& message) {
  uint64_t bytes = 4 + 2 * 32 + 4;
  for (const SealedShare& share : message.envelopes) bytes += 8 + share.envelope.size();
  return bytes;
}

uint64_t WireBytes(const ShareInbox& message) {
  uint64_t bytes = 4;
  for (const SealedShare& share : message.envelopes) bytes += 8 + share.envelope.size();
  return bytes;
}

uint64_t WireBytes(const MaskedInput& message) { return 4 + 4 + 4 * message.values.size(); }

uint64_t WireBytes(const SurvivorSet&, uint32_t sites) { return 4 + SurvivorBitmapBytes(sites); }

uint64_t WireBytes(const SurvivorsSigned& message) { return 4 + 8 + message.signature.size(); }

uint64_t WireBytes(const UnmaskRequest& message) {
  uint64_t bytes = 4;
  for (const SurvivorsSigned& signature : message.signatures) bytes += 8 + signature.signature.size();
  return bytes;
}

uint64_t WireBytes(const UnmaskResponse& message) {
  return 4 + 8 + (4 + kShareValueBytes) * (message.seed_shares.size() + message.key_shares.size());
}

}  // namespace estuary::secagg
