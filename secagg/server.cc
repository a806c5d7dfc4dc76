#include "secagg/server.h"

#include <openssl/crypto.h>

#include <algorithm>

#include "secagg/key_agreement.h"
#include "secagg/masking.h"
#include "secagg/prg.h"

namespace estuary::secagg {
namespace {

const char* StageName(int stage) {
  static const char* const kNames[] = {"advertise keys", "share keys",   "masked input", "consistency check",
                                      "unmasking",      "done", "refused"};
  return kNames[stage];
}

}  // namespace

Result<SecAggServer> SecAggServer::Create(const ProtocolConfig& config) {
  ESTUARY_RETURN_IF_ERROR(CheckProtocolConfig(config));
  ESTUARY_ASSIGN_OR_RETURN(NeighbourGraph graph, NeighbourGraph::Harary(int(config.sites), config.degree,
                                                                        config.graph_seed));
  return SecAggServer(config, std::move(graph));
}

Status SecAggServer::Expect(Stage stage, std::string_view what, uint32_t site) {
  if (stage_ == stage) return Status::Ok();
  return FailedPrecondition("secagg round {}: {} from site {} during stage {}", config_.round, what, site,
                            StageName(int(stage_)));
}

Status SecAggServer::CheckSender(std::string_view what, uint32_t site, bool allowed, bool seen,
                                 std::string_view previous) {
  if (site >= config_.sites) {
    return ProtocolError("secagg round {}: {} from site {}, not among the {} sites", config_.round, what, site,
                         config_.sites);
  }
  if (!allowed) {
    return ProtocolError("secagg round {}: {} from site {}, which did not complete {}", config_.round, what, site,
                         previous);
  }
  if (seen) return ProtocolError("secagg round {}: a second {} from site {}", config_.round, what, site);
  return Status::Ok();
}

Status SecAggServer::CloseStage(std::string_view stage, size_t remaining, size_t before) {
  if (remaining >= size_t(config_.threshold)) return Status::Ok();
  stage_ = Stage::kFailed;
  return FailedPrecondition("secagg round {}: {}: {} of {} sites remain, fewer than the threshold {}: refusing to "
                            "proceed",
                            config_.round, stage, remaining, before, config_.threshold);
}

Status SecAggServer::Receive(const AdvertiseKeys& message) {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kAdvertise, "advertised keys", message.site));
  ESTUARY_RETURN_IF_ERROR(
      CheckSender("advertised keys", message.site, true, advertised_.contains(message.site), "nothing"));
  advertised_.emplace(message.site, message);
  return Status::Ok();
}

Result<std::map<uint32_t, KeysBroadcast>> SecAggServer::CloseAdvertise() {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kAdvertise, "closing", 0));
  ESTUARY_RETURN_IF_ERROR(CloseStage("advertise keys", advertised_.size(), config_.sites));
  std::map<uint32_t, KeysBroadcast> out;
  for (const auto& [site, keys] : advertised_) {
    KeysBroadcast& broadcast = out[site];
    for (uint32_t v : graph_.Neighbours(site)) {
      if (auto it = advertised_.find(v); it != advertised_.end()) broadcast.neighbours.push_back(it->second);
    }
  }
  stage_ = Stage::kShare;
  return out;
}

Status SecAggServer::Receive(const ShareKeys& message) {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kShare, "share keys", message.site));
  ESTUARY_RETURN_IF_ERROR(CheckSender("share keys", message.site, advertised_.contains(message.site),
                                      shared_.contains(message.site), "advertise keys"));
  // Exactly one envelope per advertised neighbour: what its KeysBroadcast held.
  std::set<uint32_t> expected, got;
  for (uint32_t v : graph_.Neighbours(message.site)) {
    if (advertised_.contains(v)) expected.insert(v);
  }
  for (const SealedShare& share : message.envelopes) {
    if (!expected.contains(share.peer)) {
      return ProtocolError("secagg round {}: share keys from site {}: envelope for site {}, not an advertised "
                           "neighbour",
                           config_.round, message.site, share.peer);
    }
    if (!got.insert(share.peer).second) {
      return ProtocolError("secagg round {}: share keys from site {}: two envelopes for site {}", config_.round,
                           message.site, share.peer);
    }
    if (share.envelope.size() != kShareEnvelopeBytes) {
      return ProtocolError("secagg round {}: share keys from site {}: envelope for site {} of {} bytes, expected {}",
                           config_.round, message.site, share.peer, share.envelope.size(), kShareEnvelopeBytes);
    }
  }
  if (got.size() != expected.size()) {
    return ProtocolError("secagg round {}: share keys from site {}: {} envelopes for its {} advertised neighbours",
                         config_.round, message.site, got.size(), expected.size());
  }
  for (const SealedShare& share : message.envelopes) mailbox_[{message.site, share.peer}] = share.envelope;
  commitments_[message.site] = {message.seed_commitment, message.key_commitment};
  shared_.insert(message.site);
  return Status::Ok();
}

Result<std::map<uint32_t, ShareInbox>> SecAggServer::CloseShareKeys() {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kShare, "closing", 0));
  ESTUARY_RETURN_IF_ERROR(CloseStage("share keys", shared_.size(), advertised_.size()));
  std::map<uint32_t, ShareInbox> out;
  for (uint32_t v : shared_) out[v];
  for (auto& [route, envelope] : mailbox_) {
    // Envelopes to sites that went silent in this stage go nowhere.
    if (shared_.contains(route.second)) out[route.second].envelopes.push_back({route.first, std::move(envelope)});
  }
  mailbox_.clear();
  sum_.assign(config_.dimension, 0);
  stage_ = Stage::kMask;
  return out;
}

Status SecAggServer::Receive(const MaskedInput& message) {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kMask, "masked input", message.site));
  ESTUARY_RETURN_IF_ERROR(CheckSender("masked input", message.site, shared_.contains(message.site),
                                      included_.contains(message.site) || withdrawn_.contains(message.site) ||
                                          partial_.contains(message.site),
                                      "share keys"));
  if (message.values.size() != config_.dimension) {
    return ProtocolError("secagg round {}: masked input from site {}: {} elements, expected {}", config_.round,
                         message.site, message.values.size(), config_.dimension);
  }
  ESTUARY_RETURN_IF_ERROR(ReceiveMaskedChunk(message.site, 0, message.values));
  return FinishMaskedInput(message.site);
}

Status SecAggServer::ReceiveMaskedChunk(uint32_t site, uint64_t offset, std::span<const uint32_t> values) {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kMask, "masked input", site));
  ESTUARY_RETURN_IF_ERROR(CheckSender("masked input", site, shared_.contains(site),
                                      included_.contains(site) || withdrawn_.contains(site), "share keys"));
  const auto it = partial_.find(site);
  const uint64_t received = it == partial_.end() ? 0 : it->second.received;
  if (offset != received || values.empty() || values.size() > config_.dimension - received) {
    return ProtocolError("secagg round {}: masked input from site {}: a chunk of {} elements at element {}, expected "
                         "the next of {} at {}",
                         config_.round, site, values.size(), offset, config_.dimension, received);
  }
  const uint32_t ring = RingMask(config_.bits);
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] > ring) {
      return ProtocolError("secagg round {}: masked input from site {}: element {} = {} is outside the {}-bit ring",
                           config_.round, site, offset + i, values[i], config_.bits);
    }
  }
  ESTUARY_RETURN_IF_ERROR(AddInto(std::span(sum_).subspan(offset, values.size()), values, config_.bits));
  Partial& partial = partial_[site];
  partial.received += values.size();
  partial.digest += MaskedDigest(offset, values);
  return Status::Ok();
}

Status SecAggServer::FinishMaskedInput(uint32_t site) {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kMask, "masked input", site));
  ESTUARY_RETURN_IF_ERROR(CheckSender("masked input", site, shared_.contains(site),
                                      included_.contains(site) || withdrawn_.contains(site), "share keys"));
  const auto it = partial_.find(site);
  const uint64_t received = it == partial_.end() ? 0 : it->second.received;
  if (received != config_.dimension) {
    return ProtocolError("secagg round {}: masked input from site {} ends after {} of {} elements", config_.round,
                         site, received, config_.dimension);
  }
  partial_.erase(it);
  included_.insert(site);
  return Status::Ok();
}

Status SecAggServer::WithdrawMaskedInput(uint32_t site, const ChunkReader& read, uint64_t piece) {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kMask, "withdrawing a masked input", site));
  const auto it = partial_.find(site);
  if (it == partial_.end()) {
    return FailedPrecondition("secagg round {}: withdrawing site {}'s masked input, which is not partly in the sum",
                              config_.round, site);
  }
  const Partial partial = it->second;
  partial_.erase(it);
  withdrawn_.insert(site);
  std::vector<uint32_t> values;
  uint64_t digest = 0;
  Status status;
  for (uint64_t at = 0; at < partial.received && status.ok(); at += values.size()) {
    values.resize(std::min<uint64_t>(std::max<uint64_t>(piece, 1), partial.received - at));
    status = read(at, values);
    if (!status.ok()) break;
    digest += MaskedDigest(at, values);
    status = SubtractFrom(std::span(sum_).subspan(at, values.size()), values, config_.bits);
  }
  if (status.ok() && digest == partial.digest) return Status::Ok();
  stage_ = Stage::kFailed;
  return Internal("secagg round {}: masked input: withdrawing site {}'s {} elements: {}: the sum is lost",
                  config_.round, site, partial.received,
                  status.ok() ? "the copy read back is not what was added" : status.message());
}

Result<SurvivorSet> SecAggServer::CloseMaskedInput() {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kMask, "closing", 0));
  if (!partial_.empty()) {
    const auto& [site, partial] = *partial_.begin();
    return FailedPrecondition("secagg round {}: masked input: site {}'s input is partly in the sum ({} of {} "
                              "elements): it must finish or be withdrawn before the stage closes",
                              config_.round, site, partial.received, config_.dimension);
  }
  ESTUARY_RETURN_IF_ERROR(CloseStage("masked input", included_.size(), shared_.size()));
  stage_ = Stage::kConsistency;
  return SurvivorSet{.survived = std::vector<uint32_t>(included_.begin(), included_.end())};
}

Status SecAggServer::Receive(const SurvivorsSigned& message) {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kConsistency, "signed survivor set", message.site));
  ESTUARY_RETURN_IF_ERROR(CheckSender("signed survivor set", message.site, included_.contains(message.site),
                                      signed_.contains(message.site), "masked input"));
  if (message.signature.empty() || message.signature.size() > kMaxSurvivorSignatureBytes) {
    return ProtocolError("secagg round {}: signed survivor set from site {}: a signature of {} bytes, expected 1 to {}",
                         config_.round, message.site, message.signature.size(), kMaxSurvivorSignatureBytes);
  }
  signed_.emplace(message.site, message.signature);
  return Status::Ok();
}

Result<std::map<uint32_t, UnmaskRequest>> SecAggServer::CloseConsistency() {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kConsistency, "closing", 0));
  ESTUARY_RETURN_IF_ERROR(CloseStage("consistency check", signed_.size(), included_.size()));
  // No sets: each site unmasks by the U3 it signed, so a request is only its
  // neighbours' signatures, O(k).
  std::map<uint32_t, UnmaskRequest> out;
  for (const auto& [u, signature] : signed_) {
    UnmaskRequest& request = out[u];
    for (uint32_t v : graph_.Neighbours(u)) {
      if (auto it = signed_.find(v); it != signed_.end()) request.signatures.push_back({v, it->second});
    }
  }
  stage_ = Stage::kUnmask;
  return out;
}

Status SecAggServer::Receive(const UnmaskResponse& message) {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kUnmask, "unmasking response", message.site));
  ESTUARY_RETURN_IF_ERROR(CheckSender("unmasking response", message.site, signed_.contains(message.site),
                                      responded_.contains(message.site), "consistency check"));
  const std::string where = fmt::format("secagg round {}: unmasking response from site {}", config_.round, message.site);
  // A holder answers for its neighbours that shared keys, each in its list.
  std::set<uint32_t> seen;
  auto check = [&](const std::vector<PeerShare>& shares, bool survived) -> Status {
    for (const PeerShare& share : shares) {
      if (share.peer >= config_.sites || !graph_.Adjacent(message.site, share.peer) || !shared_.contains(share.peer)) {
        return ProtocolError("{}: a share of site {}, whose shares it does not hold", where, share.peer);
      }
      if (included_.contains(share.peer) != survived) {
        return ProtocolError("{}: a {} share of site {}, which {}", where, survived ? "self-mask seed" : "mask key",
                             share.peer, survived ? "dropped" : "survived");
      }
      if (!seen.insert(share.peer).second) return ProtocolError("{}: two shares of site {}", where, share.peer);
    }
    return Status::Ok();
  };
  ESTUARY_RETURN_IF_ERROR(check(message.seed_shares, true));
  ESTUARY_RETURN_IF_ERROR(check(message.key_shares, false));
  for (const PeerShare& share : message.seed_shares) {
    seed_shares_[share.peer].push_back({.x = message.site + 1, .y = share.y});
  }
  for (const PeerShare& share : message.key_shares) {
    key_shares_[share.peer].push_back({.x = message.site + 1, .y = share.y});
  }
  responded_.insert(message.site);
  return Status::Ok();
}

Result<AggregateOutput> SecAggServer::Finish() {
  ESTUARY_RETURN_IF_ERROR(Expect(Stage::kUnmask, "finishing", 0));
  ESTUARY_RETURN_IF_ERROR(CloseStage("unmasking", responded_.size(), signed_.size()));
  stage_ = Stage::kFailed;  // until the sum is out
  auto enough = [&](const std::map<uint32_t, std::vector<Share>>& shares, uint32_t site,
                    std::string_view secret) -> Status {
    const auto it = shares.find(site);
    const size_t have = it == shares.end() ? 0 : it->second.size();
    if (have >= size_t(config_.threshold)) return Status::Ok();
    return FailedPrecondition("secagg round {}: unmasking: site {}'s {} has {} shares, fewer than the threshold {}: "
                              "refusing to proceed",
                              config_.round, site, secret, have, config_.threshold);
  };
  // t shares suffice and the commitment catches a wrong one among them;
  // checking the others against their polynomial as well (Combine does, given
  // more) would cost the server (k − t) interpolations per site and could only
  // name a liar whose share was not needed.
  auto FirstT = [&](const std::vector<Share>& shares) { return std::span(shares).first(config_.threshold); };
  AggregateOutput out;
  for (uint32_t u : included_) {
    ESTUARY_RETURN_IF_ERROR(enough(seed_shares_, u, "self-mask seed"));
    auto seed = Combine(FirstT(seed_shares_.at(u)), config_.threshold, commitments_.at(u).seed);
    if (!seed.ok()) {
      return FailedPrecondition("secagg round {}: unmasking: site {}'s self-mask seed: {}", config_.round, u,
                                seed.status().message());
    }
    ESTUARY_RETURN_IF_ERROR(RemoveSelfMask(*seed, config_.bits, 0, sum_));
    OPENSSL_cleanse(seed->data(), seed->size());
    out.included.push_back(u);
  }
  for (uint32_t d : shared_) {
    if (included_.contains(d)) continue;
    ESTUARY_RETURN_IF_ERROR(enough(key_shares_, d, "mask key"));
    auto key = Combine(FirstT(key_shares_.at(d)), config_.threshold, commitments_.at(d).key);
    if (!key.ok()) {
      return FailedPrecondition("secagg round {}: unmasking: site {}'s mask key: {}", config_.round, d,
                                key.status().message());
    }
    ESTUARY_ASSIGN_OR_RETURN(X25519KeyPair pair, X25519KeyPairFromPrivate(*key));
    if (pair.public_key != advertised_.at(d).mask_public_key) {
      return FailedPrecondition("secagg round {}: unmasking: site {}'s reconstructed mask key does not match its "
                                "advertised public key",
                                config_.round, d);
    }
    // The neighbours that masked with d: those that had its envelope and sent.
    std::vector<PeerPublicKey> survivors;
    for (uint32_t v : graph_.Neighbours(d)) {
      if (included_.contains(v)) survivors.push_back({v, advertised_.at(v).mask_public_key});
    }
    ESTUARY_RETURN_IF_ERROR(RemoveDroppedSiteMasks(d, *key, survivors, config_.round, config_.bits, 0, sum_));
    OPENSSL_cleanse(key->data(), key->size());
    OPENSSL_cleanse(pair.private_key.data(), pair.private_key.size());
    out.dropped.push_back(d);
  }
  out.sum = std::move(sum_);
  stage_ = Stage::kDone;
  return out;
}

}  // namespace estuary::secagg
