// A site's side of SecAgg+ (secagg/protocol.h): one object per site and
// round, driven by whatever relays its messages.
//
//   auto client = SecAggClient::Create(config, site);
//   AdvertiseKeys a = client->Advertise();                  // round 0
//   ShareKeys s     = client->Share(keys_broadcast);         // round 1
//   MaskedInput y   = client->MaskInput(inbox, quantized);   // round 2
//   std::string m   = client->ConfirmSurvivors(u3);          // round 3: the site signs m
//   UnmaskResponse r = client->Unmask(request, check);       // round 4
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
//
// The consistency check (Bonawitz et al. §4; Bell et al.'s malicious-server
// variant). Before revealing anything, the site confirms the survivor set U3
// it was told by signing it, and reveals its shares only for that U3 — the
// request names no set of its own: the site reveals b_v for its neighbours in
// the U3 it signed and sk_v for those outside it whose shares it holds — and
// only when the request carries valid signatures over that same U3 from at
// least t of its neighbours in U3. A server that told two sites two different U3 (to get
// b_v from some neighbours of v and sk_v from others) then holds no t
// signatures on either story that the other side accepts. A signature that
// does not verify is refused, as is one from a site outside U3 or not a
// neighbour, or a second one from the same site.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>

#include "base/status.h"
#include "secagg/key_agreement.h"
#include "secagg/masking.h"
#include "secagg/neighbours.h"
#include "secagg/protocol.h"

namespace estuary::secagg {

// What a site confirmed in round 3, computed once per round: the bytes it
// signed (SurvivorsToSign, 4 bytes a survivor) and their SHA-256, so that
// checking k signatures over them need not hash them k times.
struct ConfirmedSurvivors {
  std::string_view message;
  std::string_view sha256;  // 32 bytes
};

// Verifies `signer`'s signature over `confirmed.message`: OK, or one line why
// not. Over the federation's connections, the signer's certificate key as its
// advertised keys were signed (client/secagg_site.h).
using SignatureCheck =
    std::function<Status(uint32_t signer, const ConfirmedSurvivors& confirmed, std::string_view signature)>;

// In one process — the simulator's in-process mode, tests, benchmarks — no
// site has a certificate: a site's "signature" is the SHA-256 of the bytes
// it confirmed (32 bytes, where a site's ECDSA signature is 70 to 72), and
// the check compares it with the digest of the site's own (computed once, so
// the check is O(1)). It catches a different survivor set, but authenticates
// nobody; nothing that crosses a network may use it.
std::string UnauthenticatedSignature(std::string_view message);
Status UnauthenticatedSurvivorsCheck(uint32_t signer, const ConfirmedSurvivors& confirmed,
                                     std::string_view signature);

class SecAggClient {
 public:
  // Draws the site's two key pairs. Refuses a bad config or site id.
  static Result<SecAggClient> Create(const ProtocolConfig& config, uint32_t site);

  SecAggClient(SecAggClient&&) = default;
  SecAggClient& operator=(SecAggClient&&) = default;
  ~SecAggClient();

  uint32_t site() const { return site_; }
  const SiteNeighbours& neighbours() const { return neighbours_; }

  // Round 0: the public keys.
  Result<AdvertiseKeys> Advertise();
  // Round 1: the neighbours' keys in; b_u and sk_u split t-of-(those
  // neighbours), one envelope to each.
  Result<ShareKeys> Share(const KeysBroadcast& keys);
  // Round 2: the envelopes addressed to it in (opened and kept); `quantized`
  // (config.dimension ring elements) masked with b_u and the pairwise masks
  // of the inbox's senders.
  Result<MaskedInput> MaskInput(const ShareInbox& inbox, std::span<const uint32_t> quantized);
  // Round 2 as it streams, what MaskInput does at once: BeginMaskedInput
  // takes the inbox in (as MaskInput); MaskChunk masks, in place, the next
  // elements [offset, offset + values.size()) of the quantised input, in
  // order from 0; FinishMaskedInput, once all config.dimension elements are
  // masked, ends the stage. The pairwise keys live from Begin to Finish.
  Status BeginMaskedInput(const ShareInbox& inbox);
  Status MaskChunk(uint64_t offset, std::span<uint32_t> values);
  Status FinishMaskedInput();
  // Round 3: U3 checked (ids in range, no repeats, this site in it, at least
  // t sites) and kept; the bytes the site signs to confirm it.
  Result<std::string> ConfirmSurvivors(const SurvivorSet& survivors);
  // Round 4: the shares the U3 confirmed implies — b_v for each neighbour v
  // in it, sk_v for each neighbour outside it whose shares this site holds —
  // once `check` accepts the signatures of at least t neighbours in U3 over
  // the bytes this site signed.
  Result<UnmaskResponse> Unmask(const UnmaskRequest& request, const SignatureCheck& check);

 private:
  enum class Stage { kAdvertise, kShare, kMask, kMasking, kConsistency, kUnmask, kDone };
  SecAggClient(const ProtocolConfig& config, uint32_t site, SiteNeighbours neighbours)
      : config_(config), site_(site), neighbours_(std::move(neighbours)) {}
  Status Expect(Stage stage, std::string_view call);
  // `status` as the site's refusal: the stage ends.
  Status Refuse(Status status);

  struct HeldShares {
    std::array<uint8_t, kShareValueBytes> seed{}, key{};
  };

  ProtocolConfig config_;
  uint32_t site_ = 0;
  SiteNeighbours neighbours_;  // its own k, not the graph's n · k
  Stage stage_ = Stage::kAdvertise;
  X25519KeyPair mask_keys_, share_keys_;
  Key32 self_seed_{};
  std::map<uint32_t, AdvertiseKeys> peers_;  // neighbours that advertised
  std::map<uint32_t, HeldShares> held_;      // from the inbox's senders
  // The share keys agreed to seal this site's envelopes, kept to open the
  // neighbours' (the key is symmetric): one X25519 a neighbour, not two.
  std::map<uint32_t, Key32> share_key_with_;
  std::vector<PairwiseKey> pairwise_;        // while masking: s_uv with the inbox's senders
  uint64_t masked_ = 0;                      // while masking: elements masked so far
  std::vector<bool> survivors_;              // U3, as this site confirmed it: by id
  std::string confirmed_;                    // SurvivorsToSign(config_, U3)
  std::string confirmed_sha256_;             // its SHA-256
};

}  // namespace estuary::secagg
