// A site's side of SecAgg+ (secagg/protocol.h): one object per site and
// round, driven by whatever relays its messages.
//
//   auto client = SecAggClient::Create(config, site);
//   AdvertiseKeys a = client->Advertise();                  // round 0
//   ShareKeys s     = client->Share(keys_broadcast);         // round 1
//   MaskedInput y   = client->MaskInput(inbox, quantized);   // round 2
//   UnmaskResponse r = client->Unmask(request);              // round 3
//
// The calls must come in this order, each once; anything else is refused.
// Every incoming message is checked before anything is derived from it, and
// any refusal (a malformed message, a tampered envelope, fewer than t
// neighbours left, a request for both secrets of one peer) ends the site's
// part in the round: it answers nothing more, so a server cannot probe it
// with a second try.
//
// What the site guarantees. Its secrets — the self-mask seed b_u and the mask
// private key sk_u, fresh from RAND_bytes each round — leave it only as
// Shamir shares sealed to its neighbours. In round 3 it reveals, per
// neighbour, the share of b_v (v survived) or of sk_v (v dropped), never
// both, and answers once. It refuses to mask when fewer than t neighbours
// shared keys with it (then its own b_u could never be reconstructed) and to
// unmask when fewer than t sites are said to have survived, as Bonawitz et
// al. require (below t, the sum could be close to a single input).
#pragma once

#include <cstdint>
#include <map>
#include <span>

#include "base/status.h"
#include "secagg/key_agreement.h"
#include "secagg/neighbours.h"
#include "secagg/protocol.h"

namespace estuary::secagg {

class SecAggClient {
 public:
  // Draws the site's two key pairs. Refuses a bad config or site id.
  static Result<SecAggClient> Create(const ProtocolConfig& config, uint32_t site);

  SecAggClient(SecAggClient&&) = default;
  SecAggClient& operator=(SecAggClient&&) = default;
  ~SecAggClient();

  uint32_t site() const { return site_; }
  const NeighbourGraph& graph() const { return graph_; }

  // Round 0: the public keys.
  Result<AdvertiseKeys> Advertise();
  // Round 1: the neighbours' keys in; b_u and sk_u split t-of-(those
  // neighbours), one envelope to each.
  Result<ShareKeys> Share(const KeysBroadcast& keys);
  // Round 2: the envelopes addressed to it in (opened and kept); `quantized`
  // (config.dimension ring elements) masked with b_u and the pairwise masks
  // of the inbox's senders.
  Result<MaskedInput> MaskInput(const ShareInbox& inbox, std::span<const uint32_t> quantized);
  // Round 3: the shares the request asks for.
  Result<UnmaskResponse> Unmask(const UnmaskRequest& request);

 private:
  enum class Stage { kAdvertise, kShare, kMask, kUnmask, kDone };
  SecAggClient(const ProtocolConfig& config, uint32_t site, NeighbourGraph graph)
      : config_(config), site_(site), graph_(std::move(graph)) {}
  Status Expect(Stage stage, std::string_view call);
  // `status` as the site's refusal: the stage ends.
  Status Refuse(Status status);

  struct HeldShares {
    std::array<uint8_t, kShareValueBytes> seed{}, key{};
  };

  ProtocolConfig config_;
  uint32_t site_ = 0;
  NeighbourGraph graph_;
  Stage stage_ = Stage::kAdvertise;
  X25519KeyPair mask_keys_, share_keys_;
  Key32 self_seed_{};
  std::map<uint32_t, AdvertiseKeys> peers_;  // neighbours that advertised
  std::map<uint32_t, HeldShares> held_;      // from the inbox's senders
};

}  // namespace estuary::secagg
