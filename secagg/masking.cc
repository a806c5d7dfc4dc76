#include "secagg/masking.h"

#include <set>

#include "secagg/key_agreement.h"
#include "secagg/prg.h"

namespace estuary::secagg {

Result<std::vector<PairwiseKey>> PairwiseMaskKeys(uint32_t site, const Key32& mask_private_key,
                                                  std::span<const PeerPublicKey> neighbours, uint64_t round) {
  std::vector<PairwiseKey> keys;
  keys.reserve(neighbours.size());
  for (const PeerPublicKey& peer : neighbours) {
    if (peer.site == site) return InvalidArgument("secagg: site {} listed as its own neighbour", site);
    ESTUARY_ASSIGN_OR_RETURN(Key32 key, AgreeRoundKey(mask_private_key, peer.public_key, kMaskKeyLabel, round));
    keys.push_back({peer.site, key});
  }
  return keys;
}

Status MaskChunk(uint32_t site, const Key32& self_seed, std::span<const PairwiseKey> pairwise, int bits,
                 uint64_t offset, std::span<uint32_t> values) {
  ESTUARY_RETURN_IF_ERROR(CheckRingBits(bits));
  std::set<uint32_t> seen;
  for (const PairwiseKey& pair : pairwise) {
    if (pair.neighbour == site) return InvalidArgument("secagg: site {} listed as its own neighbour", site);
    if (!seen.insert(pair.neighbour).second) {
      return InvalidArgument("secagg: site {}: neighbour {} listed twice", site, pair.neighbour);
    }
  }
  std::vector<SignedSeed> masks = {{&self_seed, MaskSign::kAdd}};
  for (const PairwiseKey& pair : pairwise) {
    masks.push_back({&pair.key, site < pair.neighbour ? MaskSign::kAdd : MaskSign::kSubtract});
  }
  return ApplyMasks(masks, offset, bits, values);
}

Status AddInto(std::span<uint32_t> sum, std::span<const uint32_t> values, int bits) {
  ESTUARY_RETURN_IF_ERROR(CheckRingBits(bits));
  if (sum.size() != values.size()) {
    return InvalidArgument("secagg: adding {} elements into a sum of {}", values.size(), sum.size());
  }
  const uint32_t mask = RingMask(bits);
  for (size_t i = 0; i < sum.size(); ++i) sum[i] = (sum[i] + values[i]) & mask;
  return Status::Ok();
}

Status SubtractFrom(std::span<uint32_t> sum, std::span<const uint32_t> values, int bits) {
  ESTUARY_RETURN_IF_ERROR(CheckRingBits(bits));
  if (sum.size() != values.size()) {
    return InvalidArgument("secagg: subtracting {} elements from a sum of {}", values.size(), sum.size());
  }
  const uint32_t mask = RingMask(bits);
  for (size_t i = 0; i < sum.size(); ++i) sum[i] = (sum[i] - values[i]) & mask;
  return Status::Ok();
}

uint64_t MaskedDigest(uint64_t offset, std::span<const uint32_t> values) {
  uint64_t digest = 0;
  for (size_t i = 0; i < values.size(); ++i) digest += uint64_t(values[i]) * (2 * (offset + i) + 1);
  return digest;
}

Status RemoveSelfMask(const Key32& self_seed, int bits, uint64_t offset, std::span<uint32_t> sum) {
  return ApplyMask(self_seed, offset, bits, MaskSign::kSubtract, sum);
}

Status RemoveDroppedSiteMasks(uint32_t dropped, const Key32& dropped_mask_private_key,
                              std::span<const PeerPublicKey> surviving_neighbours, uint64_t round, int bits,
                              uint64_t offset, std::span<uint32_t> sum) {
  ESTUARY_RETURN_IF_ERROR(CheckRingBits(bits));
  std::set<uint32_t> seen;
  std::vector<Key32> keys;
  keys.reserve(surviving_neighbours.size());  // SignedSeed points into it: no reallocation
  std::vector<SignedSeed> undo;
  for (const PeerPublicKey& peer : surviving_neighbours) {
    if (peer.site == dropped) return InvalidArgument("secagg: dropped site {} listed among its survivors", dropped);
    if (!seen.insert(peer.site).second) {
      return InvalidArgument("secagg: dropped site {}: surviving neighbour {} listed twice", dropped, peer.site);
    }
    ESTUARY_ASSIGN_OR_RETURN(Key32 key,
                             AgreeRoundKey(dropped_mask_private_key, peer.public_key, kMaskKeyLabel, round));
    keys.push_back(key);
    // What v applied for d: +PRG if v < d, −PRG if v > d. Undo it.
    undo.push_back({&keys.back(), peer.site < dropped ? MaskSign::kSubtract : MaskSign::kAdd});
  }
  const Status status = ApplyMasks(undo, offset, bits, sum);
  for (Key32& key : keys) key.fill(0);
  return status;
}

}  // namespace estuary::secagg
