// SecAgg+'s messages (secagg/protocol.h) as the federation's wire messages
// (proto/estuary.proto's SecAgg*), both ways. The state machines never see
// this file: it is what the server's sessions and a site's agent relay them
// with. Every From* checks what the wire can get wrong before a struct exists
// — fixed sizes (32-byte keys and commitments, 160-byte envelopes, 66-byte
// share values, signatures of 1 to kMaxSurvivorSignatureBytes, the survivor
// bitmap's length and its bits past the sites), the round, the count of ring
// elements in a chunk — and
// names the field in its one-line error; ids, sets and stages are the state
// machines' to check.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "estuary.pb.h"
#include "secagg/protocol.h"

namespace estuary::secagg {

// The protocol of a round as its setup announces it to `site`, and back.
v1::SecAggSetup ToProto(const ProtocolConfig& config, uint32_t site, double clip, double scale, uint64_t weight);
Result<ProtocolConfig> ConfigFromProto(const v1::SecAggSetup& setup, uint64_t round);

v1::SecAggAdvertise ToProto(const AdvertiseKeys& message, uint64_t round);
Result<AdvertiseKeys> FromProto(const v1::SecAggAdvertise& message, uint32_t site);
v1::SecAggKeys ToProto(const KeysBroadcast& message, uint64_t round);
Result<KeysBroadcast> FromProto(const v1::SecAggKeys& message);
v1::SecAggShares ToProto(const ShareKeys& message, uint64_t round);
Result<ShareKeys> FromProto(const v1::SecAggShares& message, uint32_t site);
v1::SecAggInbox ToProto(const ShareInbox& message, uint64_t round);
Result<ShareInbox> FromProto(const v1::SecAggInbox& message);
// U3 as a bitmap over ids 0..sites-1 (proto/estuary.proto's
// survived_bitmap): ceil(sites / 8) bytes, where a list would take 4 a site.
// ToProto expects ids below `sites` (the server's U3); FromProto refuses a
// bitmap of another length or with a bit set past `sites`, and gives the ids
// in ascending order.
v1::SecAggSurvivors ToProto(const SurvivorSet& message, uint64_t round, uint32_t sites);
Result<SurvivorSet> FromProto(const v1::SecAggSurvivors& message, uint32_t sites);
v1::SecAggSurvivorsSigned ToProto(const SurvivorsSigned& message, uint64_t round);
Result<SurvivorsSigned> FromProto(const v1::SecAggSurvivorsSigned& message, uint32_t site);
v1::SecAggUnmask ToProto(const UnmaskRequest& message, uint64_t round);
Result<UnmaskRequest> FromProto(const v1::SecAggUnmask& message);
v1::SecAggUnmaskResponse ToProto(const UnmaskResponse& message, uint64_t round);
Result<UnmaskResponse> FromProto(const v1::SecAggUnmaskResponse& message, uint32_t site);

// The bytes a site signs over the keys it advertises (SecAggAdvertise's
// signature, crypto/site_signature.h): a fixed label, the round, the sites
// and the graph seed of the setup, the site's id and both keys. Bound so, a
// signature cannot be replayed into another round nor relayed as another
// site's keys. The label's version names the masks' generator (v2:
// AES-256-CTR, secagg/prg.h; v1 was ChaCha20): sites of two builds whose
// masks would not cancel refuse each other's keys, and the round fails at
// its second stage, instead of committing a sum that is noise.
std::string AdvertisementToSign(const ProtocolConfig& config, const AdvertiseKeys& keys);

// A chunk's ring elements (little-endian uint32) appended to `out`, which
// must hold exactly `chunk.offset()` elements so far and at most `dimension`
// after.
Status AppendMaskedChunk(const v1::SecAggMaskedChunk& chunk, uint64_t dimension, std::vector<uint32_t>& out);
// The chunk's elements into `out` (resized to them), checked as
// AppendMaskedChunk checks them with `expected_offset` elements already in.
Status DecodeMaskedChunk(const v1::SecAggMaskedChunk& chunk, uint64_t expected_offset, uint64_t dimension,
                         std::vector<uint32_t>& out);
// The frame that opens a site's masked input: a SecAggMaskedChunk at element
// 0 with no data. Like UpdateBegin it asks the server for one of its staging
// slots; while none is free the server reads nothing more from the site, so
// the chunks wait in its socket (server/secagg_state.h).
v1::Envelope MaskedBeginMessage(uint64_t round);
bool IsMaskedBegin(const v1::SecAggMaskedChunk& chunk);
// The frame of elements [offset, offset + values.size()) of a masked input.
v1::Envelope MaskedChunkMessage(uint64_t round, uint64_t offset, std::span<const uint32_t> values);

}  // namespace estuary::secagg
