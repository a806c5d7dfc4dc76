// The server's side of SecAgg+ (secagg/protocol.h): collects each round's
// messages, relays what the sites need, and at the end reconstructs from the
// survivors' shares what it must to unmask the sum.
//
//   auto server = SecAggServer::Create(config);
//   server->Receive(advertise) ...;  auto keys = server->CloseAdvertise();      // per site
//   server->Receive(share_keys) ...; auto inboxes = server->CloseShareKeys();   // per site
//   server->Receive(masked) ...;     auto survivors = server->CloseMaskedInput();  // U3, to each included site
//   server->Receive(signed) ...;     auto requests = server->CloseConsistency();   // per site that signed
//   server->Receive(response) ...;   auto output = server->Finish();
//
// Receive checks a message against the stage and the sets so far (sender in
// range, in the previous stage's set, not a repeat; sizes; ids in its
// neighbourhood) and refuses it with one line, changing nothing: its sender
// simply counts as silent. Sites that never send are the dropouts; closing a
// stage fixes who made it.
//
// Thresholds. Closing a stage with fewer than t sites left refuses to go on
// with "secagg round R: <stage>: N of M sites remain, fewer than the
// threshold t". Finish also needs, per site it unmasks, t shares of the secret
// it needs: "... site u's self-mask seed has 2 shares, fewer than the
// threshold 3". After a refusal every later call fails.
//
// The output: Σ x_u mod 2^bits over the sites whose MaskedInput arrived, the
// self masks removed (b_u from t shares, checked against u's commitment) and
// the pairwise masks of sites that shared keys but never sent their input
// cancelled (sk_d from t shares, checked against d's commitment and its
// advertised public key).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <span>
#include <vector>

#include "base/status.h"
#include "secagg/neighbours.h"
#include "secagg/protocol.h"

namespace estuary::secagg {

class SecAggServer {
 public:
  static Result<SecAggServer> Create(const ProtocolConfig& config);

  const ProtocolConfig& config() const { return config_; }
  const NeighbourGraph& graph() const { return graph_; }

  Status Receive(const AdvertiseKeys& message);
  // Per site that advertised: its advertised neighbours' keys.
  Result<std::map<uint32_t, KeysBroadcast>> CloseAdvertise();

  Status Receive(const ShareKeys& message);
  // Per site that shared keys: the envelopes addressed to it by the others
  // that did.
  Result<std::map<uint32_t, ShareInbox>> CloseShareKeys();

  // A whole masked input at once: ReceiveMaskedChunk of all of it, then
  // FinishMaskedInput.
  Status Receive(const MaskedInput& message);
  // Round 2 as it streams. Each chunk of a site's masked input — elements
  // [offset, offset + values.size()), in order from 0 — is checked and added
  // into the sum as it arrives; FinishMaskedInput, once all `dimension`
  // elements are in, puts the site in U3. A refused chunk adds nothing.
  Status ReceiveMaskedChunk(uint32_t site, uint64_t offset, std::span<const uint32_t> values);
  Status FinishMaskedInput(uint32_t site);
  // Whether `site` has chunks in the sum but has not finished: then it must
  // finish or be withdrawn before the stage closes.
  bool PartlyReceived(uint32_t site) const { return partial_.contains(site); }
  // Undoes a site whose input stopped partway (its connection lost, refused,
  // silent at the deadline): what it added is subtracted again, the caller's
  // copy of it read back through `read` (elements [offset, offset + n) into
  // `values`) a piece of at most `piece` elements at a time, and the site
  // counts as never having sent. The copy is checked against a digest of what
  // was added; a mismatch leaves the sum wrong, so the stage fails
  // (Internal) and every later call with it. The masking is additive mod 2^b,
  // so subtracting the same elements restores the sum exactly.
  using ChunkReader = std::function<Status(uint64_t offset, std::span<uint32_t> values)>;
  Status WithdrawMaskedInput(uint32_t site, const ChunkReader& read, uint64_t piece = 1u << 16);
  // U3: what every site whose input arrived is asked to sign. Refused while
  // a site's input is partly in the sum.
  Result<SurvivorSet> CloseMaskedInput();

  // A signature over U3, kept as it came: the sites verify it, not the server.
  Status Receive(const SurvivorsSigned& message);
  // Per site that signed: the unmasking request, the signatures of its
  // neighbours that signed (the site unmasks by the U3 it signed).
  Result<std::map<uint32_t, UnmaskRequest>> CloseConsistency();

  Status Receive(const UnmaskResponse& message);
  Result<AggregateOutput> Finish();

 private:
  enum class Stage { kAdvertise, kShare, kMask, kConsistency, kUnmask, kDone, kFailed };
  SecAggServer(const ProtocolConfig& config, NeighbourGraph graph) : config_(config), graph_(std::move(graph)) {}
  Status Expect(Stage stage, std::string_view what, uint32_t site);
  // `allowed`: the sender completed `previous`; `seen`: it already sent this.
  Status CheckSender(std::string_view what, uint32_t site, bool allowed, bool seen, std::string_view previous);
  // The stage's survivors against t.
  Status CloseStage(std::string_view stage, size_t remaining, size_t before);

  struct Commitments {
    Commitment seed{}, key{};
  };

  ProtocolConfig config_;
  NeighbourGraph graph_;
  Stage stage_ = Stage::kAdvertise;
  std::map<uint32_t, AdvertiseKeys> advertised_;                          // U1
  std::map<uint32_t, Commitments> commitments_;                           // U2
  std::map<std::pair<uint32_t, uint32_t>, std::vector<uint8_t>> mailbox_;  // (from, to) -> envelope
  std::set<uint32_t> shared_;                                              // U2
  std::set<uint32_t> included_;                                            // U3
  std::vector<uint32_t> sum_;
  // Sites whose input is partly in the sum: the elements added so far and
  // MaskedDigest of them.
  struct Partial {
    uint64_t received = 0;
    uint64_t digest = 0;
  };
  std::map<uint32_t, Partial> partial_;
  std::set<uint32_t> withdrawn_;  // stopped partway and subtracted: silent from then on
  std::map<uint32_t, std::string> signed_;                                 // U4: their signatures over U3
  std::set<uint32_t> responded_;                                           // U5
  std::map<uint32_t, std::vector<Share>> seed_shares_, key_shares_;       // by owner
};

}  // namespace estuary::secagg
